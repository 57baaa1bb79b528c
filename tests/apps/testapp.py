#!/usr/bin/env python3
"""A small HTTP program for valet's tests: what an app of a user's does, and each way
an app can misbehave. Standard library only.

It serves on $PORT and keeps its state under $VALET_DATA_DIR. TESTAPP_MODE picks a
misbehaviour at start:
  exit-at-start   prints a line and exits 2 before it listens
  wrong-port      listens on another port (one the kernel picks), not $PORT
  not-ready       answers 503 to everything
  ignore-term     ignores SIGTERM (so it is killed after the grace)
  fork            starts a child and a grandchild (its own session) that append to
                  $VALET_DATA_DIR/orphan-writes every 10 ms while they live
  slow-start=S    sleeps S seconds before it listens

Paths (valet's readiness probe, by its user agent, gets 200 "ready" on any):
  GET  /                counts a request in $VALET_DATA_DIR/count, answers "count N"
  GET  /read/NAME       the file NAME of the data directory (404 when missing)
  PUT  /write/NAME      writes the body to NAME
  GET  /grow/N          writes N bytes to $VALET_DATA_DIR/big
  GET  /random/N        writes N random bytes to $VALET_DATA_DIR/random
  GET  /pids            this process's pid, and its children's
  GET  /env/NAME        the environment variable NAME
  GET  /crash           exits 3 without answering
  GET  /alloc/MB        allocates MB megabytes and answers how much it holds; out of
                        memory, it says so and exits 1, as most apps do
  GET  /rlimits         its RLIMIT_AS, RLIMIT_CPU and RLIMIT_NOFILE (soft limits)
  GET  /spin            burns CPU until it is stopped
  POST /echo            the body back
  GET  /slow/MS         answers after MS milliseconds
  Upgrade: echo         101, then every byte back until the client closes
"""

import http.server
import os
import signal
import subprocess
import sys
import time

PORT = int(os.environ["PORT"])
DATA = os.environ["VALET_DATA_DIR"]
MODE = os.environ.get("TESTAPP_MODE", "")
children = []
held = []


def log(*args):
    print(*args, flush=True)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("request " + (fmt % args) + "\n")
        sys.stderr.flush()

    def answer(self, status, body, ctype="text/plain"):
        if isinstance(body, str):
            body = body.encode()
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if MODE == "not-ready":
            return self.answer(503, "never ready\n")
        if self.headers.get("user-agent") == "valet-probe":
            return self.answer(200, "ready\n")
        if self.headers.get("upgrade", "").lower() == "echo":
            self.send_response(101)
            self.send_header("upgrade", "echo")
            self.send_header("connection", "upgrade")
            self.end_headers()
            self.wfile.flush()
            while True:
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                self.connection.sendall(chunk)
            self.close_connection = True
            return
        path = self.path.split("?")[0]
        if path == "/":
            f = os.path.join(DATA, "count")
            n = int(open(f).read()) + 1 if os.path.exists(f) else 1
            with open(f + ".tmp", "w") as out:
                out.write(str(n))
            os.replace(f + ".tmp", f)
            return self.answer(200, "count %d\n" % n)
        if path.startswith("/read/"):
            f = os.path.join(DATA, path[len("/read/"):])
            if not os.path.exists(f):
                return self.answer(404, "no such file\n")
            return self.answer(200, open(f, "rb").read())
        if path.startswith("/grow/"):
            n = int(path[len("/grow/"):])
            with open(os.path.join(DATA, "big"), "wb") as out:
                out.write(b"x" * n)
            return self.answer(200, "grew to %d\n" % n)
        if path.startswith("/random/"):
            n = int(path[len("/random/"):])
            with open(os.path.join(DATA, "random"), "wb") as out:
                out.write(os.urandom(n))
            return self.answer(200, "wrote %d random bytes\n" % n)
        if path == "/pids":
            pids = [os.getpid()] + [c.pid for c in children]
            return self.answer(200, " ".join(map(str, pids)) + "\n")
        if path.startswith("/env/"):
            return self.answer(200, os.environ.get(path[len("/env/"):], "") + "\n")
        if path == "/crash":
            sys.stderr.write("crashing on purpose\n")
            sys.stderr.flush()
            os._exit(3)
        if path.startswith("/alloc/"):
            mb = int(path[len("/alloc/"):])
            try:
                held.append(bytearray(mb << 20))
            except MemoryError:
                sys.stderr.write("out of memory allocating %d MiB\n" % mb)
                sys.stderr.flush()
                os._exit(1)
            return self.answer(200, "holding %d MiB\n" % sum(len(h) >> 20 for h in held))
        if path == "/rlimits":
            import resource
            limits = [resource.getrlimit(r)[0] for r in (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_NOFILE)]
            return self.answer(200, " ".join(map(str, limits)) + "\n")
        if path == "/spin":
            while True:
                pass
        if path.startswith("/slow/"):
            time.sleep(int(path[len("/slow/"):]) / 1000)
            return self.answer(200, "slow done\n")
        return self.answer(404, "unknown path\n")

    def do_PUT(self):
        path = self.path.split("?")[0]
        n = int(self.headers.get("content-length", "0"))
        body = self.rfile.read(n)
        if path.startswith("/write/"):
            with open(os.path.join(DATA, path[len("/write/"):]), "wb") as out:
                out.write(body)
            return self.answer(200, "wrote %d\n" % len(body))
        return self.answer(404, "unknown path\n")

    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        body = self.rfile.read(n)
        return self.answer(200, body, "application/octet-stream")


def main():
    if MODE == "exit-at-start":
        log("exiting at start on purpose")
        sys.exit(2)
    if MODE.startswith("slow-start="):
        time.sleep(float(MODE.split("=", 1)[1]))
    if MODE == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if MODE == "fork":
        writer = "import os,time\nwhile True:\n    open(os.path.join(os.environ['VALET_DATA_DIR'],'orphan-writes'),'a').write('x')\n    time.sleep(0.01)\n"
        children.append(subprocess.Popen([sys.executable, "-c", writer]))
        # This one leaves the group, and keeps every descriptor (the directory's lock).
        children.append(subprocess.Popen([sys.executable, "-c", writer], start_new_session=True, close_fds=False))
    # Port 0: the kernel picks a free one (PORT + 1 may be taken by another test).
    port = 0 if MODE == "wrong-port" else PORT
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    log("listening on 127.0.0.1:%d, data in %s" % (port, DATA))
    server.serve_forever()


if __name__ == "__main__":
    main()
