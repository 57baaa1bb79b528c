//! The catalog: atespaces and actor records (create, read, list, delete).

use tonic::Status;
use valet_proto::ateapi;

use super::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, Op, OpKind, OpTarget, Plane, aborted, not_found};
use crate::model::{self, ActorKey, ActorStatus};
use crate::store::{ActorRow, Batch};

/// How long a worker may take to read an actor's output.
const LOGS_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// The plane's catalog: atespaces and actors created, read, listed and deleted.
/// Obtained with [`Plane::catalog`].
#[derive(Debug, Clone, Copy)]
pub struct Catalog<'a> {
    plane: &'a Plane,
}

impl Plane {
    /// The plane's catalog.
    pub fn catalog(&self) -> Catalog<'_> {
        Catalog { plane: self }
    }
}

impl Catalog<'_> {
    /// `CreateAtespace`.
    pub async fn create_atespace(&self, name: &str) -> Result<ateapi::Atespace, Status> {
        let plane = self.plane;
        model::check_name("atespace", name)?;
        let name = name.to_owned();
        let detached = plane.clone();
        let plane = plane.clone();
        detached
            .detached(async move {
                let op = {
                    let mut st = plane.lock();
                    let target = OpTarget::Atespace(name.clone());
                    if st.records.has_atespace(&name) || st.ops.holder(&target).is_some() {
                        return Err(Status::already_exists(format!(
                            "atespace {name} already exists"
                        )));
                    }
                    Op::take(&plane, &mut st, target, OpKind::Busy("creating"))
                };
                let batch = Batch {
                    put_atespaces: vec![name.clone()],
                    ..Batch::default()
                };
                plane.ledger().finish(op, batch).await?;
                Ok(ateapi::Atespace { name })
            })
            .await
    }

    /// `GetAtespace`.
    pub fn get_atespace(&self, name: &str) -> Result<ateapi::Atespace, Status> {
        let plane = self.plane;
        model::check_name("atespace", name)?;
        if plane.lock().records.has_atespace(name) {
            Ok(ateapi::Atespace {
                name: name.to_owned(),
            })
        } else {
            Err(Status::not_found(format!("atespace {name} not found")))
        }
    }

    /// `ListAtespaces`.
    pub fn list_atespaces(&self) -> Vec<ateapi::Atespace> {
        let plane = self.plane;
        plane
            .lock()
            .records
            .atespaces()
            .map(|n| ateapi::Atespace { name: n.clone() })
            .collect()
    }

    /// `DeleteAtespace`: only an empty one.
    pub async fn delete_atespace(&self, name: &str) -> Result<(), Status> {
        let plane = self.plane;
        model::check_name("atespace", name)?;
        let name = name.to_owned();
        let detached = plane.clone();
        let plane = plane.clone();
        detached
            .detached(async move {
                let op = {
                    let mut st = plane.lock();
                    if !st.records.has_atespace(&name) {
                        return Err(Status::not_found(format!("atespace {name} not found")));
                    }
                    let target = OpTarget::Atespace(name.clone());
                    let busy_inside = st.ops.inside(&name);
                    if st.ops.holder(&target).is_some() || busy_inside {
                        return Err(aborted());
                    }
                    if st.records.keys().any(|k| k.atespace() == name) {
                        return Err(Status::failed_precondition(format!(
                            "atespace {name} still has actors; delete them first"
                        )));
                    }
                    Op::take(&plane, &mut st, target, OpKind::Busy("deleting"))
                };
                let batch = Batch {
                    delete_atespaces: vec![name.clone()],
                    ..Batch::default()
                };
                plane.ledger().finish(op, batch).await
            })
            .await
    }

    /// `CreateActor`: a SUSPENDED actor of `template_name` (whose pool it runs in).
    pub async fn create_actor(
        &self,
        key: ActorKey,
        template_namespace: &str,
        template_name: &str,
        selector: Vec<(String, String)>,
    ) -> Result<ateapi::Actor, Status> {
        let plane = self.plane;
        let template = plane.template(template_name).ok_or_else(|| {
            Status::failed_precondition(format!(
                "ActorTemplate {}/{} not found",
                crate::model::shown(template_namespace),
                crate::model::shown(template_name)
            ))
        })?;
        let row = ActorRow {
            atespace: key.atespace().to_owned(),
            name: key.name().to_owned(),
            uid: format!("{:016x}", rand::random::<u64>()),
            template_namespace: template_namespace.to_owned(),
            template: template.name().to_owned(),
            pool: template.pool().to_owned(),
            status: ActorStatus::Suspended,
            version: 1,
            worker: None,
            selector,
            revert_pending: false,
            op_replica: None,
            snapshot: String::new(),
            reason: String::new(),
        };
        let detached = plane.clone();
        let plane = plane.clone();
        detached
            .detached(async move {
                let op = {
                    let mut st = plane.lock();
                    if !st.records.has_atespace(key.atespace()) {
                        return Err(Status::failed_precondition(format!(
                            "atespace {} not found; create it first",
                            key.atespace()
                        )));
                    }
                    if st
                        .ops
                        .holder(&OpTarget::Atespace(key.atespace().to_owned()))
                        .is_some()
                    {
                        return Err(aborted());
                    }
                    if st.records.contains(&key) || st.busy(&key).is_some() {
                        return Err(Status::already_exists(format!(
                            "actor {key} already exists"
                        )));
                    }
                    Op::take(
                        &plane,
                        &mut st,
                        OpTarget::Actor(key),
                        OpKind::Busy("creating"),
                    )
                };
                plane.ledger().finish(op, Batch::put([row.clone()])).await?;
                Ok(plane.lock().to_proto(&row))
            })
            .await
    }

    /// `GetActor`.
    pub fn get_actor(&self, key: &ActorKey) -> Result<ateapi::Actor, Status> {
        let plane = self.plane;
        let st = plane.lock();
        let row = st.records.get(key).ok_or_else(|| not_found(key))?;
        Ok(st.to_proto(row))
    }

    /// `GetActorLogs`: the last output of `key`'s program, from the worker hosting it
    /// (or claimed for it), else from any worker of its pool attached here (workers
    /// of a pool share the snapshot directory where the output is kept). The output
    /// and the worker that answered.
    ///
    /// # Errors
    /// `NotFound`; `Unavailable` when no worker can answer.
    pub async fn actor_logs(&self, key: &ActorKey) -> Result<(Vec<u8>, String), Status> {
        let plane = self.plane;
        let (link, worker, slot) = {
            let st = plane.lock();
            let row = st.records.get(key).ok_or_else(|| not_found(key))?;
            let hosting = row.worker.as_ref().and_then(|w| {
                st.workers
                    .get(w)
                    .map(|rec| (std::sync::Arc::clone(rec.link()), w.clone()))
            });
            let any = || {
                st.workers
                    .iter()
                    .filter(|(_, w)| w.pool() == row.pool)
                    .min_by_key(|(id, _)| (*id).clone())
                    .map(|(id, w)| (std::sync::Arc::clone(w.link()), id.clone()))
            };
            let (link, worker) = hosting.or_else(any).ok_or_else(|| {
                Status::unavailable(format!(
                    "no worker of pool {} is attached to this control plane to read the output of actor {key}",
                    row.pool
                ))
            })?;
            (link, worker, super::slot_of(key, row))
        };
        let reply = link
            .call(
                valet_proto::worker::worker_command::Command::Logs(valet_proto::worker::Logs {
                    actor: Some(slot),
                }),
                LOGS_WITHIN,
            )
            .await
            .map_err(|e| {
                Status::unavailable(format!(
                    "worker {worker} could not read the output of actor {key}: {e}"
                ))
            })?;
        Ok((reply.output, worker))
    }

    /// One page of actors, ordered by `atespace/name`; `page_size` is clamped to
    /// [`MAX_PAGE_SIZE`].
    pub fn list_actors(
        &self,
        atespace: &str,
        page_size: i32,
        page_token: &str,
    ) -> Result<(Vec<ateapi::Actor>, String), Status> {
        let plane = self.plane;
        if !atespace.is_empty() {
            model::check_name("atespace", atespace)?;
        }
        let size = match usize::try_from(page_size) {
            Ok(0) | Err(_) => DEFAULT_PAGE_SIZE,
            Ok(n) => n.min(MAX_PAGE_SIZE),
        };
        let after = if page_token.is_empty() {
            None
        } else {
            let (a, n) = page_token
                .split_once('/')
                .ok_or_else(|| Status::invalid_argument("invalid page_token"))?;
            Some(ActorKey::new(a, n).map_err(|_| Status::invalid_argument("invalid page_token"))?)
        };
        let st = plane.lock();
        let mut page = Vec::with_capacity(size.min(st.records.len()));
        let mut last = None;
        let mut more = false;
        let range = match &after {
            Some(k) => st.records.range((
                std::ops::Bound::Excluded(k.clone()),
                std::ops::Bound::Unbounded,
            )),
            None => st
                .records
                .range((std::ops::Bound::Unbounded, std::ops::Bound::Unbounded)),
        };
        for (k, row) in range {
            if !atespace.is_empty() && k.atespace() != atespace {
                continue;
            }
            if page.len() == size {
                more = true;
                break;
            }
            page.push(st.to_proto(row));
            last = Some(k.clone());
        }
        let token = match (more, last) {
            (true, Some(k)) => k.to_string(),
            _ => String::new(),
        };
        Ok((page, token))
    }

    /// `DeleteActor`: only SUSPENDED or CRASHED actors.
    pub async fn delete_actor(&self, key: ActorKey) -> Result<(), Status> {
        let plane = self.plane;
        let detached = plane.clone();
        let plane = plane.clone();
        detached.detached(async move {
            let op = {
                let mut st = plane.lock();
                let status = st.records.get(&key).ok_or_else(|| not_found(&key))?.status;
                if st.busy(&key).is_some() {
                    return Err(aborted());
                }
                if !matches!(status, ActorStatus::Suspended | ActorStatus::Crashed) {
                    return Err(Status::failed_precondition(format!(
                        "actor {key} is {status}; only SUSPENDED or CRASHED actors can be deleted"
                    )));
                }
                Op::take(
                    &plane,
                    &mut st,
                    OpTarget::Actor(key.clone()),
                    OpKind::Busy("deleting"),
                )
            };
            let batch = Batch {
                delete_actors: vec![key],
                ..Batch::default()
            };
            plane.ledger().finish(op, batch).await
        })
        .await
    }
}
