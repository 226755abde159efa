//! Forwarding headers from arbitrary bytes: never a panic, bounded work, and whatever a client
//! puts to the left of what the trusted proxy appended never changes the client found.
#![no_main]

use std::net::IpAddr;

use fleetlimit::key::{client_ip, ForwardedHeader, TrustedProxies};
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, client_part)) = data.split_first() else {
        return;
    };
    let trusted = TrustedProxies::private_networks();
    let peer: IpAddr = [10, 0, 0, 1].into();
    let (name, appended, which) = match selector % 2 {
        0 => ("x-forwarded-for", "198.51.100.7", ForwardedHeader::XForwardedFor),
        _ => ("forwarded", "for=198.51.100.7", ForwardedHeader::Forwarded),
    };
    // Arbitrary lines alone: any outcome, no panic.
    let mut headers = HeaderMap::new();
    for line in client_part.split(|&b| b == b'\n') {
        if let Ok(v) = HeaderValue::from_bytes(line) {
            headers.append(name, v);
        }
    }
    let _ = client_ip(peer, &headers, &trusted, which);
    // The proxy's append, after whatever the client sent: always the appended client.
    let mut line = client_part.to_vec();
    line.extend_from_slice(b", ");
    line.extend_from_slice(appended.as_bytes());
    if let Ok(v) = HeaderValue::from_bytes(&line) {
        let mut headers = HeaderMap::new();
        headers.append(name, v);
        let found = client_ip(peer, &headers, &trusted, which);
        assert_eq!(found, IpAddr::from([198, 51, 100, 7]), "{line:?}");
    }
});
