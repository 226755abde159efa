//! Redis as it is deployed: TLS (with a CA the test makes, and mutual TLS) and Sentinel
//! failover under load, against real `redis-server` processes the harness starts.

mod support;

use std::time::{Duration, Instant};

use fleetlimit::store::{Check, Op, RedisStore, Store};
use fleetlimit::{Algorithm, Key, Limiter, OnStoreError, Quota, Rule, Source};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use support::redis::RedisServer;

fn rule(limit: u64) -> Rule {
    Rule::new(
        "deployed",
        Quota::per_hour(limit)
            .algorithm(Algorithm::FixedWindow)
            .build()
            .unwrap(),
    )
    .unwrap()
}

/// PEM files of a CA, a server certificate for 127.0.0.1 and a client certificate it signed.
struct Pki {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
}

fn pki() -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "fleetlimit test CA");
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::from_params(&ca_params, &ca_key);
    let server_key = KeyPair::generate().unwrap();
    let mut server = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    server
        .subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    server
        .distinguished_name
        .push(DnType::CommonName, "127.0.0.1");
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_cert = server.signed_by(&server_key, &issuer).unwrap();
    let client_key = KeyPair::generate().unwrap();
    let mut client = CertificateParams::new(vec!["client".to_owned()]).unwrap();
    client.distinguished_name.push(DnType::CommonName, "client");
    client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client_cert = client.signed_by(&client_key, &issuer).unwrap();
    Pki {
        ca: ca.pem(),
        server_cert: server_cert.pem(),
        server_key: server_key.serialize_pem(),
        client_cert: client_cert.pem(),
        client_key: client_key.serialize_pem(),
    }
}

/// A server with a TLS port besides its plain one (the harness probes the plain one).
fn tls_server(pki: &Pki, auth_clients: &str) -> (RedisServer, u16) {
    let dir = std::env::temp_dir().join(format!(
        "fleetlimit-pki-{}-{auth_clients}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    };
    let (ca, cert, key) = (
        write("ca.pem", &pki.ca),
        write("server.pem", &pki.server_cert),
        write("server.key", &pki.server_key),
    );
    let tls_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let server = RedisServer::start_with_args(&[
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        auth_clients,
    ]);
    (server, tls_port.parse().unwrap())
}

async fn consume(store: &RedisStore, key: &str) -> Result<bool, fleetlimit::StoreError> {
    let r = rule(10);
    let k = Key::new(key);
    let d = store
        .apply(
            Op::Consume,
            &[Check {
                rule: &r,
                key: &k,
                cost: 1,
            }],
        )
        .await?;
    Ok(d[0].allowed)
}

#[tokio::test]
async fn rediss_with_our_ca_and_mutual_tls() {
    let pki = pki();
    let (server, port) = tls_server(&pki, "optional");
    let url = format!("rediss://127.0.0.1:{port}");
    let store = RedisStore::builder()
        .ca_certificate(pki.ca.clone())
        .connect(&url)
        .await
        .unwrap();
    assert!(consume(&store, "tls").await.unwrap());
    // The count is on the server (read over the plain port, before the timings below let the
    // hour's window end).
    let key = store.key_for(&rule(10), &Key::new("tls"));
    assert_eq!(
        server.cmd_bytes(&[b"HGET", &key, b"c"]).unwrap().as_int(),
        Some(1)
    );
    // What TLS costs per decision, beside the plain port of the same server (printed, not
    // asserted: timings are the machine's).
    let plain = RedisStore::connect(&server.url()).await.unwrap();
    let mut timings = Vec::new();
    for (name, s) in [("plain", &plain), ("tls", &store)] {
        let started = Instant::now();
        for i in 0..500 {
            let _ = consume(s, &format!("cost-{i}")).await.unwrap();
        }
        timings.push((name, started.elapsed() / 500));
    }
    eprintln!("decision round trip, same server: {timings:?}");
    // Without our CA the server's certificate is not trusted: no decision.
    let untrusting = RedisStore::builder().connect(&url).await.unwrap();
    assert!(consume(&untrusting, "tls").await.is_err());
    // A CA that is no certificate is a configuration error, at once.
    assert!(matches!(
        RedisStore::builder()
            .ca_certificate("not a certificate")
            .connect(&url)
            .await,
        Err(fleetlimit::Error::Config(_))
    ));

    // Mutual TLS: the server requires a client certificate.
    let (_mtls, port) = tls_server(&pki, "yes");
    let url = format!("rediss://127.0.0.1:{port}");
    let anonymous = RedisStore::builder()
        .ca_certificate(pki.ca.clone())
        .connect(&url)
        .await
        .unwrap();
    assert!(consume(&anonymous, "m").await.is_err());
    let known = RedisStore::builder()
        .ca_certificate(pki.ca.clone())
        .client_certificate(pki.client_cert.clone(), pki.client_key.clone())
        .connect(&url)
        .await
        .unwrap();
    assert!(consume(&known, "m").await.unwrap());
}

/// A CA given with Sentinel is a configuration error, against a live Sentinel that would
/// otherwise be used: redis-rs cannot pass it to the master a Sentinel names, and the store
/// once accepted it and reached that master without it.
#[tokio::test]
async fn a_ca_with_sentinel_is_refused_not_dropped() {
    let pki = pki();
    let master = RedisServer::start();
    let sentinel = RedisServer::start_sentinel("fleet", master.port(), 1);
    let url = sentinel.url();
    let refused = RedisStore::builder()
        .ca_certificate(pki.ca.clone())
        .sentinel(&[&url], "fleet")
        .await;
    assert!(
        matches!(
            &refused,
            Err(fleetlimit::Error::Config(
                fleetlimit::ConfigError::Invalid {
                    setting: "ca_certificate",
                    ..
                }
            ))
        ),
        "{refused:?}"
    );
    let plain = RedisStore::builder()
        .sentinel(&[&url], "fleet")
        .await
        .unwrap();
    let started = Instant::now();
    while consume(&plain, "through-sentinel").await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the master is never found"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A server that asks for a password: the right one connects; none, or a wrong one, is a
/// configuration error when the store is built (it was a warning, and every decision then
/// followed the outage policy for good), and the message never shows the password.
#[tokio::test]
async fn refused_credentials_are_a_configuration_error() {
    let server = RedisServer::start();
    server
        .cmd(&["CONFIG", "SET", "requirepass", "s3cret-pw"])
        .unwrap();
    let port = server.port();
    for url in [
        format!("redis://127.0.0.1:{port}"),
        format!("redis://:not-the-pw@127.0.0.1:{port}"),
    ] {
        let refused = RedisStore::connect(&url).await;
        let message = format!("{refused:?}");
        assert!(
            matches!(
                &refused,
                Err(fleetlimit::Error::Config(
                    fleetlimit::ConfigError::Invalid { setting: "url", .. }
                ))
            ) && message.contains("credentials"),
            "{url}: {message}"
        );
        assert!(!message.contains("not-the-pw"), "{message}");
    }
    let good = RedisStore::connect(&format!("redis://:s3cret-pw@127.0.0.1:{port}"))
        .await
        .unwrap();
    assert!(consume(&good, "authorised").await.unwrap());
}

/// A cluster whose nodes ask for a password refuses a store without it: a configuration error
/// when built, as on a standalone server.
#[tokio::test]
async fn a_cluster_refusing_the_credentials_is_a_configuration_error() {
    let cluster = support::redis::RedisCluster::start();
    for node in cluster.nodes() {
        node.cmd(&["CONFIG", "SET", "requirepass", "s3cret-pw"])
            .unwrap();
    }
    let urls = cluster.urls();
    let wrong: Vec<String> = urls
        .iter()
        .map(|u| u.replacen("redis://", "redis://:not-the-pw@", 1))
        .collect();
    for urls in [urls, wrong] {
        let refused = RedisStore::builder().cluster(&urls).await;
        let message = format!("{refused:?}");
        assert!(message.contains("credentials"), "{urls:?}: {message}");
        assert!(!message.contains("not-the-pw"), "{message}");
    }
}

/// A master that asks for a password, found through a Sentinel: its credentials go to the
/// master (the Sentinel's URL has none), and decisions are the store's. Without them, the
/// master refuses the store, which says so when built (redis-rs reached the master with no
/// password, whatever the Sentinel URLs said).
#[tokio::test]
async fn sentinel_reaches_a_master_that_asks_for_a_password() {
    let master = RedisServer::start();
    let sentinel = RedisServer::start_sentinel("guarded", master.port(), 1);
    master
        .cmd(&["CONFIG", "SET", "requirepass", "s3cret-pw"])
        .unwrap();
    sentinel
        .cmd(&["SENTINEL", "SET", "guarded", "auth-pass", "s3cret-pw"])
        .unwrap();
    let url = sentinel.url();
    let builder = RedisStore::builder().sentinel_master_auth(None, "s3cret-pw");
    assert!(!format!("{builder:?}").contains("s3cret-pw"), "{builder:?}");
    let authorised = builder.sentinel(&[&url], "guarded").await.unwrap();
    let started = Instant::now();
    while consume(&authorised, "guarded").await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the master is never reached"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Without them, the master refuses the store: a configuration error when it is built.
    let without = RedisStore::builder().sentinel(&[&url], "guarded").await;
    assert!(
        format!("{without:?}").contains("credentials"),
        "{without:?}"
    );
}

/// A master, a replica and three Sentinels. Under load, the master is killed: decisions follow
/// the policy until the replica is promoted, then come from it, with no restart. Prints the
/// recovery time and the counts lost to asynchronous replication.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_under_load() {
    let mut master = RedisServer::start();
    let replica =
        RedisServer::start_with_args(&["--replicaof", "127.0.0.1", &master.port().to_string()]);
    let sentinels: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::start_sentinel("fleet", master.port(), 2))
        .collect();
    // Wait until the replica is in sync and every Sentinel knows it.
    let started = Instant::now();
    loop {
        let synced = replica
            .info("replication")
            .is_ok_and(|i| i.contains("master_link_status:up"));
        let known = sentinels.iter().all(|s| {
            s.cmd(&["SENTINEL", "REPLICAS", "fleet"])
                .ok()
                .and_then(|r| r.as_array().map(|a| !a.is_empty()))
                .unwrap_or(false)
        });
        if synced && known {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the topology never settled"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let urls: Vec<String> = sentinels.iter().map(|s| s.url()).collect();
    let store = RedisStore::builder()
        .sentinel(&urls, "fleet")
        .await
        .unwrap();
    let limiter = Limiter::builder(store)
        .rule(rule(1_000_000))
        .on_store_error(OnStoreError::fail_closed())
        .deny_cache(0)
        .build()
        .unwrap();
    let key = Key::new("failover");
    let mut acknowledged = 0u64;
    let run = |limiter: Limiter, until: Instant| {
        let key = key.clone();
        async move {
            let mut samples = Vec::new();
            while Instant::now() < until {
                let asked = Instant::now();
                let d = limiter.consume(&key, 1).await.unwrap();
                samples.push((asked, asked.elapsed(), d));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            samples
        }
    };
    let before = run(limiter.clone(), Instant::now() + Duration::from_millis(500)).await;
    acknowledged += before
        .iter()
        .filter(|(_, _, d)| d.source == Source::Store)
        .count() as u64;
    assert!(acknowledged > 20, "{acknowledged}");
    let killed = Instant::now();
    master.kill();
    // Until decisions come from Redis again, then a little more.
    let mut after = Vec::new();
    let recovered = loop {
        let batch = run(limiter.clone(), Instant::now() + Duration::from_millis(200)).await;
        let back = batch
            .iter()
            .find(|(_, _, d)| d.source == Source::Store)
            .map(|(at, _, _)| *at);
        after.extend(batch);
        if let Some(at) = back {
            break at.duration_since(killed);
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "never recovered"
        );
    };
    after.extend(run(limiter.clone(), Instant::now() + Duration::from_millis(300)).await);
    // The margin is for a loaded 2-core machine's scheduling; a decision that waited on the
    // dead master until a connect timeout would take seconds.
    let deadline = fleetlimit::DEFAULT_DEADLINE + Duration::from_millis(250);
    for (_, waited, d) in &after {
        assert!(*waited <= deadline, "a decision waited {waited:?}");
        assert!(
            d.source == Source::Store || (d.degraded && !d.allowed),
            "{d:?}"
        );
    }
    acknowledged += after
        .iter()
        .filter(|(_, _, d)| d.source == Source::Store)
        .count() as u64;
    // A call abandoned at the deadline may still have run on the master and been replicated:
    // those are counted but not acknowledged.
    let abandoned = after.iter().filter(|(_, _, d)| d.degraded).count() as u64;
    let counted = 1_000_000 - limiter.peek(&key).await.unwrap().remaining;
    let lost = acknowledged.saturating_sub(counted);
    eprintln!(
        "sentinel failover: recovered after {recovered:?}; {acknowledged} admissions acknowledged, {counted} counted by the new master, {lost} lost to asynchronous replication"
    );
    assert!(recovered < Duration::from_secs(15), "{recovered:?}");
    assert!(
        counted <= acknowledged + abandoned,
        "the new master counts what was admitted, and what was abandoned at the deadline, at most"
    );
}
