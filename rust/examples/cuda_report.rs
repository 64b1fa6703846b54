//! Print ptxas's report for every CUDA source of the library at one architecture (a
//! development aid): `cargo run --example cuda_report -- sm_80`.
fn main() {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "sm_90a".into());
    match mlx_native::backend::cuda::compile_check(&arch, &mlx_native::default_registry().cuda_sources()) {
        Ok(r) => print!("{r}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
