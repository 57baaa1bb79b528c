//! An ext_proc client standing in for Envoy: one stream per request, kept open until
//! the router answers (as Envoy does).

use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpHeaders, ProcessingRequest, external_processor_client::ExternalProcessorClient,
    processing_request::Request as In, processing_response::Response as Out,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

/// A client of the router's ext_proc server at `addr` (connects on first use).
///
/// # Panics
/// Never: a socket address always makes a valid endpoint.
pub fn client(addr: SocketAddr) -> ExternalProcessorClient<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("a socket address makes a valid endpoint")
        .tcp_nodelay(true)
        .connect_lazy();
    ExternalProcessorClient::new(channel)
}

/// What the router answered a request's headers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Routed: the `:authority` set.
    Routed(String),
    /// A verdict: status and body.
    Verdict(i32, String),
}

/// Sends one request's headers for `host` on a new stream and waits for the answer;
/// `Err` when the stream ends without one (reset, or closed).
///
/// # Errors
/// The stream's status when it ends without an answer.
pub async fn decide(
    client: &ExternalProcessorClient<Channel>,
    host: &str,
) -> Result<Answer, tonic::Status> {
    let (tx, rx) = mpsc::channel(4);
    let mut inbound = client
        .clone()
        .process(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let headers = [(":authority", host), (":path", "/"), (":method", "GET")]
        .into_iter()
        .map(|(k, v)| HeaderValue {
            key: k.into(),
            raw_value: v.as_bytes().to_vec(),
            ..Default::default()
        })
        .collect();
    tx.send(ProcessingRequest {
        request: Some(In::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .map_err(|_| tonic::Status::internal("stream closed"))?;
    let response = tokio::time::timeout(crate::generate::NO_ANSWER_AFTER, inbound.message())
        .await
        .map_err(|_| tonic::Status::deadline_exceeded("no answer from the ext_proc server"))??
        .ok_or_else(|| tonic::Status::unknown("stream ended without an answer"))?;
    drop(tx);
    match response.response {
        Some(Out::RequestHeaders(h)) => {
            let authority = h
                .response
                .and_then(|c| c.header_mutation)
                .into_iter()
                .flat_map(|m| m.set_headers)
                .filter_map(|o| o.header)
                .find(|h| h.key == ":authority")
                .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
                .unwrap_or_default();
            Ok(Answer::Routed(authority))
        }
        Some(Out::ImmediateResponse(i)) => Ok(Answer::Verdict(
            i.status.map_or(0, |s| s.code),
            String::from_utf8_lossy(&i.body).into_owned(),
        )),
        other => Err(tonic::Status::internal(format!("unexpected {other:?}"))),
    }
}
