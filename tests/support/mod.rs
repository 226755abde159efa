//! Shared helpers for the integration tests (`mod support;` in each test file).

// Not every test binary uses every helper.
#![allow(dead_code)]

pub mod redis;
