//! libFuzzer target: `megamoe_fuzz::safetensors_file` (see that crate for what the bytes mean).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    megamoe_fuzz::safetensors_file(data);
});
