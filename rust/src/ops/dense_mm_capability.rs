//! Which compile failures mean "this device or toolchain lacks the Metal tensor API"
//! rather than "the kernel has a bug".

use crate::error::MlxError;

/// True when `err` is a shader compilation failure caused by the `metal_tensor` header (or
/// the Metal Performance Primitives tensor-ops header) being absent: an older SDK or OS,
/// or a GPU family without the tensor API. Any other error, compile errors included, is
/// not this and must surface as a bug.
pub fn is_unavailable_tensor_header(err: &MlxError) -> bool {
    let MlxError::ShaderCompilationError { message, .. } = err else {
        return false;
    };
    let missing = message.contains("file not found") || message.contains("no such file");
    let tensor_header = message.contains("metal_tensor")
        || message.contains("MetalPerformancePrimitives")
        || message.contains("mpp/tensor_ops");
    missing && tensor_header
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile_error(message: &str) -> MlxError {
        MlxError::ShaderCompilationError { name: "k".into(), message: message.into() }
    }

    #[test]
    fn a_missing_tensor_header_is_unavailability() {
        assert!(is_unavailable_tensor_header(&compile_error(
            "program_source:3:10: fatal error: 'metal_tensor' file not found"
        )));
        assert!(is_unavailable_tensor_header(&compile_error(
            "fatal error: 'MetalPerformancePrimitives/MetalPerformancePrimitives.h' file not found"
        )));
    }

    #[test]
    fn other_failures_are_bugs() {
        assert!(!is_unavailable_tensor_header(&compile_error(
            "program_source:40:5: error: use of undeclared identifier 'qh'"
        )));
        assert!(!is_unavailable_tensor_header(&compile_error("'other.h' file not found")));
        assert!(!is_unavailable_tensor_header(&MlxError::InvalidArgument("'metal_tensor' file not found".into())));
    }
}
