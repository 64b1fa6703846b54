//! Print ptxas's report for every CUDA source of the library at one architecture (a
//! development aid): `cargo run --example cuda_report -- sm_80`, or only the sources whose
//! file name contains a filter: `cargo run --example cuda_report -- sm_90a d128`; a third
//! argument `paged` reports the paged K/V modules instead (`-DMLXN_PAGED_ENTRIES=1`).
fn main() {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "sm_90a".into());
    let filter = std::env::args().nth(2).unwrap_or_default();
    let files: Vec<_> =
        mlx_native::default_registry().cuda_sources().into_iter().filter(|f| f.name.contains(&filter)).collect();
    let check = if std::env::args().nth(3).as_deref() == Some("paged") {
        mlx_native::backend::cuda::compile_check_paged
    } else {
        mlx_native::backend::cuda::compile_check
    };
    match check(&arch, &files) {
        Ok(r) => print!("{r}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
