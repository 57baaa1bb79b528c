#!/usr/bin/env python3
"""notes: a small notes service that keeps its notes in SQLite, standard library only.

It is an ordinary HTTP app, written for no platform in particular; valet runs it as an
actor because it follows two conventions: it listens on 127.0.0.1:$PORT, and it keeps
its state under $VALET_DATA_DIR (here, one SQLite file). Run alone:

    PORT=8000 VALET_DATA_DIR=/tmp/notes python3 app.py

  GET    /            every note, one per line ("<id>: <text>")
  POST   /notes       adds the request body as a note; answers its id
  GET    /notes/<id>  one note
  DELETE /notes/<id>  removes one note
  GET    /healthz     "ok" once the database is open

On SIGTERM it stops serving, closes the database and exits 0.
"""

import http.server
import os
import signal
import sqlite3
import sys
import threading

PORT = int(os.environ.get("PORT", "8000"))
DATA = os.environ.get("VALET_DATA_DIR", ".")
ACTOR = os.environ.get("VALET_ACTOR", "notes")
MAX_NOTE = 64 * 1024

os.makedirs(DATA, exist_ok=True)
db = sqlite3.connect(os.path.join(DATA, "notes.sqlite3"), check_same_thread=False)
db.execute("PRAGMA journal_mode=WAL")
db.execute("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL)")
db.commit()
lock = threading.Lock()


class Notes(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "notes/1"

    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s\n" % (ACTOR, fmt % args))

    def reply(self, status, text):
        body = text.encode()
        self.send_response(status)
        self.send_header("content-type", "text/plain; charset=utf-8")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def note_id(self):
        try:
            return int(self.path.split("?")[0][len("/notes/"):])
        except ValueError:
            return None

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/healthz":
            return self.reply(200, "ok\n")
        if path == "/":
            with lock:
                rows = db.execute("SELECT id, text FROM notes ORDER BY id").fetchall()
            return self.reply(200, "".join("%d: %s\n" % r for r in rows) or "no notes yet\n")
        if path.startswith("/notes/"):
            with lock:
                row = db.execute("SELECT text FROM notes WHERE id = ?", (self.note_id(),)).fetchone()
            return self.reply(200, row[0] + "\n") if row else self.reply(404, "no such note\n")
        return self.reply(404, "not found\n")

    def do_POST(self):
        if self.path.split("?")[0] != "/notes":
            return self.reply(404, "not found\n")
        n = int(self.headers.get("content-length") or 0)
        if n > MAX_NOTE:
            return self.reply(413, "a note holds at most %d bytes\n" % MAX_NOTE)
        text = self.rfile.read(n).decode("utf-8", "replace").strip()
        if not text:
            return self.reply(400, "an empty note\n")
        with lock:
            cur = db.execute("INSERT INTO notes (text) VALUES (?)", (text,))
            db.commit()
        return self.reply(201, "%d\n" % cur.lastrowid)

    def do_DELETE(self):
        if not self.path.startswith("/notes/"):
            return self.reply(404, "not found\n")
        with lock:
            gone = db.execute("DELETE FROM notes WHERE id = ?", (self.note_id(),)).rowcount
            db.commit()
        return self.reply(200, "deleted\n") if gone else self.reply(404, "no such note\n")


def main():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", PORT), Notes)
    server.daemon_threads = True

    def stop(signum, frame):
        threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, stop)
    print("notes for %s on 127.0.0.1:%d, data in %s" % (ACTOR, PORT, DATA), flush=True)
    # serve_forever looks for a shutdown every poll_interval (0.5 s by default): a
    # shorter one lets a SIGTERM stop the app, and its actor suspend, sooner.
    server.serve_forever(poll_interval=0.05)
    with lock:
        db.close()
    print("notes for %s stopped" % ACTOR, flush=True)


if __name__ == "__main__":
    main()
