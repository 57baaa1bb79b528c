//! The Envoy bootstrap: valid YAML whose derived values are right for several flag sets.

use valet_extproc::bootstrap::{EnvoyListeners, bootstrap_yaml};
use valet_router::RouterArgs;
use yaml_rust2::{Yaml, YamlLoader};

/// The bootstrap for a router with `flags` (Envoy on 0.0.0.0:10000), or why not.
fn bootstrap_for(flags: &[&str]) -> Result<String, valet_extproc::bootstrap::BootstrapError> {
    let config = RouterArgs::try_parse_flags(flags)
        .unwrap()
        .resolve()
        .unwrap();
    let listeners = EnvoyListeners {
        http: "0.0.0.0:10000".parse().unwrap(),
        admin: "127.0.0.1:9901".parse().unwrap(),
        https: None,
    };
    bootstrap_yaml(&config, listeners)
}

fn doc(flags: &[&str]) -> Yaml {
    let text = bootstrap_for(flags).unwrap();
    let mut docs =
        YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("invalid YAML: {e}\n{text}"));
    assert_eq!(docs.len(), 1);
    docs.remove(0)
}

fn extproc_cluster(d: &Yaml) -> &Yaml {
    d["static_resources"]["clusters"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|c| c["name"].as_str() == Some("ate-cluster"))
        .unwrap()
}

fn http_filter<'a>(d: &'a Yaml, name: &str) -> &'a Yaml {
    let hcm =
        &d["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    hcm["http_filters"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|f| f["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("filter {name} missing"))
}

fn max_requests(d: &Yaml) -> i64 {
    extproc_cluster(d)["circuit_breakers"]["thresholds"][0]["max_requests"]
        .as_i64()
        .unwrap()
}

#[test]
fn derived_values_for_flag_sets() {
    let cases: &[(&[&str], i64, &str)] = &[
        (&[], 2048, "10s"),
        (&["--parked-request-max", "100"], 1024, "10s"),
        // Parking disabled: a flight retries Aborted for 15 s.
        (&["--parked-request-max", "0"], 1024, "20s"),
        (
            &[
                "--parked-request-max",
                "3000",
                "--parked-request-budget",
                "30s",
            ],
            6000,
            "35s",
        ),
        (
            &[
                "--parked-request-max",
                "100",
                "--extproc-max-requests",
                "100",
            ],
            100,
            "10s",
        ),
        (
            &[
                "--extproc-max-requests",
                "5000",
                "--parked-request-budget",
                "1500ms",
            ],
            5000,
            "6.500s",
        ),
    ];
    for (flags, breaker, timeout) in cases {
        let d = doc(flags);
        let hcm = &d["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        assert_eq!(max_requests(&d), *breaker, "{flags:?}");
        // The workers' cluster admits as many (a freed worker may route a lot's worth
        // of parked requests at once), and never fewer than Envoy's own 1024.
        let dfp = d["static_resources"]["clusters"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|c| c["lb_policy"].as_str() == Some("CLUSTER_PROVIDED"))
            .unwrap();
        let limits = &dfp["circuit_breakers"]["thresholds"][0];
        for limit in ["max_connections", "max_requests", "max_pending_requests"] {
            assert_eq!(
                limits[limit].as_i64(),
                Some((*breaker).max(1024)),
                "{limit} {flags:?}"
            );
        }
        // A worker Envoy cannot reach, or that closes or resets the connection before
        // it answers, gets the router's 502 verdict, not Envoy's text.
        let mapper = &hcm["local_reply_config"]["mappers"][0];
        let flags_mapped: Vec<&str> = mapper["filter"]["response_flag_filter"]["flags"]
            .as_vec()
            .unwrap()
            .iter()
            .filter_map(Yaml::as_str)
            .collect();
        assert_eq!(flags_mapped, ["UF", "UH", "URX", "UC", "UR"]);
        assert_eq!(mapper["status_code"].as_i64(), Some(502));
        let body = &mapper["body_format_override"];
        assert_eq!(
            body["text_format_source"]["inline_string"].as_str(),
            Some("actor %REQ(x-actor-ref)% unreachable")
        );
        assert_eq!(
            body["content_type"].as_str(),
            Some("text/plain; charset=utf-8")
        );
        assert_eq!(hcm["use_remote_address"].as_bool(), Some(true));
        let ext = &http_filter(&d, "envoy.filters.http.ext_proc")["typed_config"];
        assert_eq!(ext["message_timeout"].as_str(), Some(*timeout), "{flags:?}");
        assert_eq!(ext["grpc_service"]["timeout"].as_str(), Some(*timeout));
        assert_eq!(ext["failure_mode_allow"].as_bool(), Some(false));
        assert_eq!(ext["status_on_error"]["code"].as_i64(), Some(503));
        assert_eq!(
            ext["mutation_rules"]["allow_all_routing"].as_bool(),
            Some(true)
        );
        let mode = &ext["processing_mode"];
        assert_eq!(mode["request_header_mode"].as_str(), Some("SEND"));
        assert_eq!(mode["response_header_mode"].as_str(), Some("SKIP"));
        assert_eq!(mode["request_body_mode"].as_str(), Some("NONE"));
        // The server ends each stream with its answer to the request headers: every
        // other phase must stay off, or Envoy would skip the server for it.
        assert_eq!(mode["response_body_mode"].as_str(), Some("NONE"));
        assert_eq!(mode["request_trailer_mode"].as_str(), Some("SKIP"));
        assert_eq!(mode["response_trailer_mode"].as_str(), Some("SKIP"));
        assert!(
            ext["allow_mode_override"].is_badvalue()
                || ext["allow_mode_override"].as_bool() == Some(false),
            "the server never asks for more phases"
        );
    }
}

#[test]
fn wiring() {
    let d = doc(&["--extproc-listen", "0.0.0.0:6000"]);
    let c = extproc_cluster(&d);
    let addr = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    assert_eq!(addr["address"].as_str(), Some("127.0.0.1"));
    assert_eq!(addr["port_value"].as_i64(), Some(6000));
    assert!(!c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]["http2_protocol_options"].is_badvalue());
    // Filter order: ext_proc, then the dynamic forward proxy, then the router.
    let hcm =
        &d["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let names: Vec<&str> = hcm["http_filters"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "envoy.filters.http.ext_proc",
            "envoy.filters.http.dynamic_forward_proxy",
            "envoy.filters.http.router"
        ]
    );
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"];
    assert_eq!(
        route["cluster"].as_str(),
        Some("dynamic_forward_proxy_cluster")
    );
    assert_eq!(
        route["timeout"].as_str(),
        Some("0s"),
        "the actor's answer is not bounded"
    );
    assert_eq!(route["idle_timeout"].as_str(), Some("300s"));
    let dfp = d["static_resources"]["clusters"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|c| c["name"].as_str() == Some("dynamic_forward_proxy_cluster"))
        .unwrap();
    assert_eq!(
        dfp["cluster_type"]["name"].as_str(),
        Some("envoy.clusters.dynamic_forward_proxy")
    );
    assert_eq!(dfp["lb_policy"].as_str(), Some("CLUSTER_PROVIDED"));
    // Idle worker connections are let go before the worker closes them itself.
    let options = &dfp["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
    assert_eq!(
        options["common_http_protocol_options"]["idle_timeout"].as_str(),
        Some("30s")
    );
    assert!(valet_proto::WORKER_POOL_IDLE < valet_proto::WORKER_APP_HEADER_TIMEOUT);
}

#[test]
fn needs_a_fixed_extproc_port() {
    let listeners = EnvoyListeners {
        http: "0.0.0.0:10000".parse().unwrap(),
        admin: "127.0.0.1:9901".parse().unwrap(),
        https: None,
    };
    for flags in [
        ["--extproc-listen", ""],
        ["--extproc-listen", "127.0.0.1:0"],
    ] {
        let config = RouterArgs::try_parse_flags(flags)
            .unwrap()
            .resolve()
            .unwrap();
        let e = bootstrap_yaml(&config, listeners.clone()).unwrap_err();
        assert!(
            e.0.starts_with("invalid configuration: --extproc-listen"),
            "{e}"
        );
    }
}

#[test]
fn an_https_listener_enforces_client_certificates_and_the_spiffe_allowlist() {
    use valet_extproc::bootstrap::EnvoyHttps;
    let config = RouterArgs::try_parse_flags(["--extproc-listen", "127.0.0.1:50051"])
        .unwrap()
        .resolve()
        .unwrap();
    let listeners = EnvoyListeners {
        http: "0.0.0.0:10000".parse().unwrap(),
        admin: "127.0.0.1:9901".parse().unwrap(),
        https: Some(EnvoyHttps {
            addr: "0.0.0.0:10443".parse().unwrap(),
            cert_file: "/etc/valet/tls.crt".into(),
            key_file: "/etc/valet/tls.key".into(),
            client_ca_file: Some("/etc/valet/clients-ca.crt".into()),
            allowed_spiffe_ids: vec![
                "spiffe://cluster.local/ns/apps/".into(),
                "spiffe://cluster.local/ns/ops/sa/admin".into(),
            ],
        }),
    };
    let text = bootstrap_yaml(&config, listeners).unwrap();
    let d = YamlLoader::load_from_str(&text).unwrap().remove(0);
    let https = &d["static_resources"]["listeners"][1];
    assert_eq!(https["name"].as_str(), Some("ingress_https_listener"));
    assert_eq!(
        https["address"]["socket_address"]["port_value"].as_i64(),
        Some(10443)
    );
    let tls = &https["filter_chains"][0]["transport_socket"]["typed_config"];
    assert_eq!(tls["require_client_certificate"].as_bool(), Some(true));
    let common = &tls["common_tls_context"];
    let alpn: Vec<&str> = common["alpn_protocols"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert_eq!(alpn, ["h2", "http/1.1"]);
    assert_eq!(
        common["tls_certificates"][0]["certificate_chain"]["filename"].as_str(),
        Some("/etc/valet/tls.crt")
    );
    let v = &common["validation_context"];
    assert_eq!(
        v["trusted_ca"]["filename"].as_str(),
        Some("/etc/valet/clients-ca.crt")
    );
    let m = v["match_typed_subject_alt_names"].as_vec().unwrap();
    assert_eq!(m[0]["san_type"].as_str(), Some("URI"));
    assert_eq!(
        m[0]["matcher"]["safe_regex"]["regex"].as_str(),
        Some(
            r"^spiffe://cluster\.local/ns/apps/(?:[^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+)(/(?:[^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+))*$"
        )
    );
    assert_eq!(
        m[1]["matcher"]["exact"].as_str(),
        Some("spiffe://cluster.local/ns/ops/sa/admin")
    );
    // The same filters as the HTTP listener: the ext_proc decision applies to both.
    let filters =
        |l: &Yaml| l["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"].clone();
    assert_eq!(
        filters(https),
        filters(&d["static_resources"]["listeners"][0])
    );
}

/// Envoy bounds ext_proc's message_timeout (budget + 5 s) to an hour: a longer budget
/// is refused, naming the flag, instead of a bootstrap Envoy would not load.
#[test]
fn a_budget_past_envoys_message_timeout_bound_is_refused() {
    let bootstrap = |budget: &str| bootstrap_for(&["--parked-request-budget", budget]);
    assert!(bootstrap("3595s").is_ok());
    let e = bootstrap("3596s").unwrap_err().to_string();
    assert!(
        e.starts_with("invalid configuration: --parked-request-budget=3596s:"),
        "{e}"
    );
    assert!(e.contains("at most 3595s"), "{e}");
}
