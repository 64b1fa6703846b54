//! `examples/c/prefill.c` builds against `include/mlx_native.h` and the library's shared
//! object with the system C compiler, and its prefill matches its float64 reference: the
//! C ABI works for a C engine as documented.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The cdylib cargo built for this test run (`target/<profile>/deps/libmlx_native.so`, beside
/// the test itself; the copy one folder up is refreshed only by `cargo build`).
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let dir = exe.parent().expect("target/<profile>/deps").to_path_buf();
    let lib = dir.join(if cfg!(target_os = "macos") { "libmlx_native.dylib" } else { "libmlx_native.so" });
    assert!(lib.exists(), "{} was not built", lib.display());
    dir
}

#[test]
fn the_c_example_runs_a_prefill_through_the_header() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let lib = library_dir();
    let exe = std::env::temp_dir().join(format!("mlxn_prefill_example_{}", std::process::id()));
    let build = Command::new(&cc)
        .args(["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("include"))
        .arg(root.join("examples/c/prefill.c"))
        .arg("-L")
        .arg(&lib)
        .args(["-lmlx_native", "-lm", "-o"])
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("{cc} could not run: {e}"));
    assert!(build.status.success(), "the example did not build:\n{}", String::from_utf8_lossy(&build.stderr));
    let run = Command::new(&exe).env("LD_LIBRARY_PATH", &lib).env("DYLD_LIBRARY_PATH", &lib).output().unwrap();
    let _ = std::fs::remove_file(&exe);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "the example failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("NMSE"), "{stdout}");
}
