//! Feeds arbitrary bytes to the destination's delta decoder, as a delta
//! page's payload arrives from the network. It must apply the record whole
//! or refuse it with a typed error and leave the page as it was; any panic
//! or write outside the page is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tern_fuzz::apply_delta(data);
});
