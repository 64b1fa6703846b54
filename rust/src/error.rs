//! The library's error type. Every failure is one of these; the C ABI turns it into a
//! status code ([`MlxError::code`]) and a per-thread message.

use std::fmt;

/// What went wrong.
#[derive(Debug, Clone, PartialEq)]
pub enum MlxError {
    /// No device of the requested kind exists (or the name is not a backend).
    DeviceNotFound(String),
    /// The backend exists in this build but cannot run here: no driver, no compiler.
    BackendUnavailable(String),
    /// A command failed while it ran on the device.
    CommandBufferError(String),
    /// A kernel source did not compile.
    ShaderCompilationError { name: String, message: String },
    /// Memory could not be allocated.
    BufferAllocationError { bytes: u64 },
    /// A parameter, shape, stride or buffer does not meet the op's contract.
    InvalidArgument(String),
    /// No kernel of that name was registered, or the backend has no form of it.
    KernelNotFound(String),
    /// A dtype the operation does not take.
    UnsupportedDtype(String),
    /// A C ABI handle that is null, closed, or of the wrong kind.
    InvalidHandle(String),
    /// A bug: a panic caught at the C ABI, or a broken invariant.
    Internal(String),
}

/// Result with [`MlxError`].
pub type Result<T> = std::result::Result<T, MlxError>;

impl MlxError {
    /// The C ABI status code of this error (0 is success and never an error).
    pub fn code(&self) -> i32 {
        match self {
            MlxError::DeviceNotFound(_) => 1,
            MlxError::BackendUnavailable(_) => 2,
            MlxError::CommandBufferError(_) => 3,
            MlxError::ShaderCompilationError { .. } => 4,
            MlxError::BufferAllocationError { .. } => 5,
            MlxError::InvalidArgument(_) => 6,
            MlxError::KernelNotFound(_) => 7,
            MlxError::UnsupportedDtype(_) => 8,
            MlxError::InvalidHandle(_) => 9,
            MlxError::Internal(_) => 10,
        }
    }

    /// The variant's name, as the Python exceptions are named after it.
    pub fn kind(&self) -> &'static str {
        match self {
            MlxError::DeviceNotFound(_) => "DeviceNotFound",
            MlxError::BackendUnavailable(_) => "BackendUnavailable",
            MlxError::CommandBufferError(_) => "CommandBufferError",
            MlxError::ShaderCompilationError { .. } => "ShaderCompilationError",
            MlxError::BufferAllocationError { .. } => "BufferAllocationError",
            MlxError::InvalidArgument(_) => "InvalidArgument",
            MlxError::KernelNotFound(_) => "KernelNotFound",
            MlxError::UnsupportedDtype(_) => "UnsupportedDtype",
            MlxError::InvalidHandle(_) => "InvalidHandle",
            MlxError::Internal(_) => "Internal",
        }
    }
}

impl fmt::Display for MlxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MlxError::DeviceNotFound(m) => write!(f, "device not found: {m}"),
            MlxError::BackendUnavailable(m) => write!(f, "backend unavailable: {m}"),
            MlxError::CommandBufferError(m) => write!(f, "command failed: {m}"),
            MlxError::ShaderCompilationError { name, message } => {
                write!(f, "kernel {name} did not compile: {message}")
            }
            MlxError::BufferAllocationError { bytes } => {
                write!(f, "could not allocate a buffer of {bytes} bytes")
            }
            MlxError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            MlxError::KernelNotFound(m) => write!(f, "kernel not found: {m}"),
            MlxError::UnsupportedDtype(m) => write!(f, "unsupported dtype: {m}"),
            MlxError::InvalidHandle(m) => write!(f, "invalid handle: {m}"),
            MlxError::Internal(m) => write!(f, "internal error (a bug in mlx-native): {m}"),
        }
    }
}

impl std::error::Error for MlxError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_nonzero() {
        let all = [
            MlxError::DeviceNotFound(String::new()),
            MlxError::BackendUnavailable(String::new()),
            MlxError::CommandBufferError(String::new()),
            MlxError::ShaderCompilationError { name: String::new(), message: String::new() },
            MlxError::BufferAllocationError { bytes: 0 },
            MlxError::InvalidArgument(String::new()),
            MlxError::KernelNotFound(String::new()),
            MlxError::UnsupportedDtype(String::new()),
            MlxError::InvalidHandle(String::new()),
            MlxError::Internal(String::new()),
        ];
        let mut codes: Vec<i32> = all.iter().map(|e| e.code()).collect();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), all.len());
        assert!(codes.iter().all(|&c| c > 0));
    }

    #[test]
    fn messages_carry_their_detail() {
        let e = MlxError::ShaderCompilationError { name: "k".into(), message: "line 3".into() };
        assert_eq!(e.to_string(), "kernel k did not compile: line 3");
        let e = MlxError::BufferAllocationError { bytes: 12 };
        assert!(e.to_string().contains("12 bytes"));
    }
}
