//! `valet ctl`: a client of any `ateapi.Control` server, with tables for people and
//! `--json` for scripts.

use std::process::ExitCode;

use serde_json::{Value, json};
use valet_proto::ateapi::{self, control_client::ControlClient};

use crate::EXIT_CONFIG;
use crate::cli::{ActorCommand, AtespaceCommand, CtlArgs, CtlCommand};

pub(crate) async fn run(args: CtlArgs) -> ExitCode {
    let resolved = valet_router::config::parse_control_planes(&args.control_plane)
        .and_then(|urls| Ok((args.ateapi.credentials(&urls[0])?, urls)));
    let (credentials, urls) = match resolved {
        Ok(r) => r,
        Err(e) => {
            say_usage!("valet ctl: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    // A resume that may wait for capacity gets that long besides its deadline.
    let waits = match &args.command {
        CtlCommand::Actor(ActorCommand::Resume {
            wait_for_capacity: Some(w),
            ..
        }) => *w,
        _ => std::time::Duration::ZERO,
    };
    let mut endpoints = Vec::new();
    for url in &urls {
        match credentials.endpoint(url) {
            Ok(e) => endpoints.push(e.connect_timeout(std::time::Duration::from_secs(3))),
            Err(e) => {
                say_usage!(
                    "valet ctl: invalid configuration: --control-plane={}: {e}",
                    args.control_plane
                );
                return ExitCode::from(EXIT_CONFIG);
            }
        }
    }
    // Replicas in turn, while the one asked cannot be reached (an answer, even
    // `Unavailable`, is the replica's own and is reported). A call that got no answer
    // in time is not asked again elsewhere: the replica may be carrying it out.
    let within = args.timeout + waits;
    let mut result = Err(CtlError::Usage("no control plane".into()));
    for (i, endpoint) in endpoints.iter().enumerate() {
        let client = ControlClient::new(
            credentials.connect_lazy(endpoint, valet_proto::auth::tcp_connector()),
        );
        result = tokio::time::timeout(within, execute(client, &args))
            .await
            .unwrap_or_else(|_| {
                Err(CtlError::Rpc(tonic::Status::deadline_exceeded(format!(
                    "no answer from {} within {within:?} (--timeout); the command may still be carried out",
                    urls[i]
                ))))
            });
        let unavailable = matches!(&result, Err(CtlError::Rpc(s)) if valet_router::control::is_transport_failure(s));
        if !unavailable || i + 1 == endpoints.len() {
            break;
        }
    }
    match result {
        Ok(out) => {
            say_raw!("{out}");
            ExitCode::SUCCESS
        }
        Err(CtlError::Usage(msg)) => {
            say_usage!("valet ctl: {msg}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(CtlError::Rpc(status)) => {
            say_err!(
                "valet ctl: {}: {}",
                valet_router::control::code_name(status.code()),
                status.message()
            );
            ExitCode::FAILURE
        }
    }
}

enum CtlError {
    Usage(String),
    Rpc(tonic::Status),
}

impl From<tonic::Status> for CtlError {
    fn from(s: tonic::Status) -> Self {
        CtlError::Rpc(s)
    }
}

fn actor_ref(s: &str) -> Result<ateapi::ActorRef, CtlError> {
    let (atespace, name) = s
        .split_once('/')
        .filter(|(a, n)| !a.is_empty() && !n.is_empty())
        .ok_or_else(|| CtlError::Usage(format!("actor {s:?}: want <atespace>/<name>")))?;
    Ok(ateapi::ActorRef {
        atespace: atespace.to_owned(),
        name: name.to_owned(),
    })
}

async fn execute(
    mut c: ControlClient<valet_proto::auth::CpChannel>,
    args: &CtlArgs,
) -> Result<String, CtlError> {
    let json = args.json;
    let out = match &args.command {
        CtlCommand::Atespace(cmd) => match cmd {
            AtespaceCommand::Create { name } => {
                let a = c
                    .create_atespace(ateapi::CreateAtespaceRequest { name: name.clone() })
                    .await?
                    .into_inner()
                    .atespace
                    .unwrap_or_default();
                render(json, json!({ "name": a.name }), || {
                    format!("atespace {} created\n", a.name)
                })
            }
            AtespaceCommand::List => {
                let list = c.list_atespaces(()).await?.into_inner().atespaces;
                let rows: Vec<Vec<String>> = list.iter().map(|a| vec![a.name.clone()]).collect();
                render(
                    json,
                    Value::Array(list.iter().map(|a| json!({ "name": a.name })).collect()),
                    || table(&["NAME"], &rows),
                )
            }
            AtespaceCommand::Delete { name } => {
                c.delete_atespace(ateapi::DeleteAtespaceRequest { name: name.clone() })
                    .await?;
                render(json, json!({ "deleted": name }), || {
                    format!("atespace {name} deleted\n")
                })
            }
        },
        CtlCommand::Actor(cmd) => match cmd {
            ActorCommand::Create {
                actor,
                template,
                template_namespace,
            } => {
                let a = c
                    .create_actor(ateapi::CreateActorRequest {
                        actor_ref: Some(actor_ref(actor)?),
                        actor_template_namespace: template_namespace.clone(),
                        actor_template_name: template.clone(),
                        worker_selector: None,
                    })
                    .await?
                    .into_inner()
                    .actor
                    .unwrap_or_default();
                one_actor(json, &a, None)
            }
            ActorCommand::Get { actor } => {
                let a = c
                    .get_actor(ateapi::GetActorRequest {
                        actor_ref: Some(actor_ref(actor)?),
                    })
                    .await?
                    .into_inner()
                    .actor
                    .unwrap_or_default();
                one_actor(json, &a, None)
            }
            ActorCommand::List {
                atespace,
                page_size,
            } => {
                let mut all = Vec::new();
                let mut token = String::new();
                loop {
                    let page = c
                        .list_actors(ateapi::ListActorsRequest {
                            page_size: *page_size,
                            page_token: token.clone(),
                            atespace: atespace.clone().unwrap_or_default(),
                        })
                        .await?
                        .into_inner();
                    all.extend(page.actors);
                    if page.next_page_token.is_empty() {
                        break;
                    }
                    token = page.next_page_token;
                }
                let rows: Vec<Vec<String>> = all.iter().map(actor_row).collect();
                render(
                    json,
                    Value::Array(all.iter().map(actor_json).collect()),
                    || table(ACTOR_HEADER, &rows),
                )
            }
            ActorCommand::Suspend { actor } => {
                let a = c
                    .suspend_actor(ateapi::SuspendActorRequest {
                        actor_ref: Some(actor_ref(actor)?),
                    })
                    .await?
                    .into_inner()
                    .actor
                    .unwrap_or_default();
                one_actor(json, &a, None)
            }
            ActorCommand::Resume {
                actor,
                wait_for_capacity,
            } => {
                let r = c
                    .resume_actor(ateapi::ResumeActorRequest {
                        actor_ref: Some(actor_ref(actor)?),
                        boot: false,
                        wait_for_capacity: wait_for_capacity.and_then(|d| d.try_into().ok()),
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                one_actor(json, &r.actor.unwrap_or_default(), Some(r.resumed))
            }
            ActorCommand::Revert { actor } => {
                let a = c
                    .revert_actor(ateapi::RevertActorRequest {
                        actor_ref: Some(actor_ref(actor)?),
                    })
                    .await?
                    .into_inner()
                    .actor
                    .unwrap_or_default();
                one_actor(json, &a, None)
            }
            ActorCommand::Logs { actor } => {
                let r = c
                    .get_actor_logs(ateapi::GetActorLogsRequest {
                        actor_ref: Some(actor_ref(actor)?),
                    })
                    .await?
                    .into_inner();
                let output = String::from_utf8_lossy(&r.output).into_owned();
                render(
                    json,
                    json!({ "actor": actor, "worker": r.worker, "output": output }),
                    || output.clone(),
                )
            }
            ActorCommand::Delete { actor } => {
                c.delete_actor(ateapi::DeleteActorRequest {
                    actor_ref: Some(actor_ref(actor)?),
                })
                .await?;
                render(json, json!({ "deleted": actor }), || {
                    format!("actor {actor} deleted\n")
                })
            }
        },
        CtlCommand::Workers => {
            let workers = c.list_workers(()).await?.into_inner().workers;
            let rows: Vec<Vec<String>> = workers
                .iter()
                .map(|w| {
                    let actor = if w.actor_id.is_empty() {
                        "-".to_owned()
                    } else {
                        format!("{}/{}", w.actor_atespace, w.actor_id)
                    };
                    vec![
                        w.worker_pod.clone(),
                        w.worker_pool.clone(),
                        w.ip.clone(),
                        actor,
                    ]
                })
                .collect();
            let values = workers
                .iter()
                .map(|w| {
                    json!({
                        "worker": w.worker_pod,
                        "pool": w.worker_pool,
                        "address": w.ip,
                        "actor": if w.actor_id.is_empty() { Value::Null } else { json!(format!("{}/{}", w.actor_atespace, w.actor_id)) },
                    })
                })
                .collect();
            render(json, Value::Array(values), || {
                table(&["WORKER", "POOL", "ADDRESS", "ACTOR"], &rows)
            })
        }
    };
    Ok(out)
}

const ACTOR_HEADER: &[&str] = &[
    "ACTOR", "STATUS", "TEMPLATE", "WORKER", "ADDRESS", "VERSION", "ACTIVITY",
];

/// What a running actor is doing: `busy`, `idle 12s`; `-` when it is not running.
fn activity(a: &ateapi::Actor) -> String {
    if a.status != ateapi::actor::Status::Running as i32 {
        return "-".into();
    }
    if a.busy {
        return "busy".into();
    }
    match a
        .idle_for
        .and_then(|d| std::time::Duration::try_from(d).ok())
    {
        Some(d) => format!("idle {}", idle_text(d)),
        None => "-".into(),
    }
}

fn idle_text(d: std::time::Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        _ => format!("{}h{}m", s / 3600, s % 3600 / 60),
    }
}

fn status_name(status: i32) -> String {
    ateapi::actor::Status::try_from(status)
        .map(|s| s.as_str_name().trim_start_matches("STATUS_").to_owned())
        .unwrap_or_else(|_| status.to_string())
}

fn address(a: &ateapi::Actor) -> String {
    if a.ateom_pod_ip.is_empty() {
        "-".to_owned()
    } else {
        format!("{}:{}", a.ateom_pod_ip, a.worker_port)
    }
}

fn actor_row(a: &ateapi::Actor) -> Vec<String> {
    vec![
        format!("{}/{}", a.atespace, a.actor_id),
        status_name(a.status),
        a.actor_template_name.clone(),
        if a.ateom_pod_name.is_empty() {
            "-".into()
        } else {
            a.ateom_pod_name.clone()
        },
        address(a),
        a.version.to_string(),
        activity(a),
    ]
}

fn actor_json(a: &ateapi::Actor) -> Value {
    json!({
        "atespace": a.atespace,
        "name": a.actor_id,
        "status": status_name(a.status),
        "template": a.actor_template_name,
        "template_namespace": a.actor_template_namespace,
        "pool": a.worker_pool_name,
        "worker": if a.ateom_pod_name.is_empty() { Value::Null } else { json!(a.ateom_pod_name) },
        "address": if a.ateom_pod_ip.is_empty() { Value::Null } else { json!(address(a)) },
        "version": a.version,
        "busy": a.busy,
        "idle_seconds": a
            .idle_for
            .and_then(|d| std::time::Duration::try_from(d).ok())
            .map(|d| d.as_secs_f64()),
        "reason": if a.status_reason.is_empty() { Value::Null } else { json!(a.status_reason) },
    })
}

fn one_actor(json_out: bool, a: &ateapi::Actor, resumed: Option<bool>) -> String {
    let mut v = actor_json(a);
    if let Some(r) = resumed {
        v["resumed"] = json!(r);
    }
    render(json_out, v, || {
        let mut out = table(ACTOR_HEADER, &[actor_row(a)]);
        if !a.status_reason.is_empty() {
            out.push_str(&format!("reason: {}\n", a.status_reason));
        }
        out
    })
}

fn render(json_out: bool, value: Value, human: impl FnOnce() -> String) -> String {
    if json_out {
        format!(
            "{}\n",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        )
    } else {
        human()
    }
}

/// A left-aligned text table with a header row.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(header.to_vec(), &mut out);
    for row in rows {
        line(row.iter().map(String::as_str).collect(), &mut out);
    }
    out
}
