//! The public C header, `include/mlx_native.h`, is cbindgen's output for `rust/src/ffi.rs`
//! with `include/cbindgen.toml`: a stale header fails here. Regenerate it with
//! `MLXN_WRITE_HEADER=1 cargo test --test c_header`.

use std::path::Path;

#[test]
fn the_committed_c_header_is_the_generated_one() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("include/cbindgen.toml")).expect("include/cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .expect("cbindgen could not read the crate")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    let path = root.join("include/mlx_native.h");
    if std::env::var("MLXN_WRITE_HEADER").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write include/mlx_native.h");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/mlx_native.h is not what cbindgen makes of rust/src/ffi.rs: run `MLXN_WRITE_HEADER=1 cargo test --test c_header`"
    );
    for name in ["mlxn_prefill_plan_new", "mlxn_prefill_plan_run", "MlxnFlashAttnPrefillParams", "mlxn_last_error"] {
        assert!(generated.contains(name), "the header lacks {name}");
    }
}
