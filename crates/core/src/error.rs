//! Errors raised by the core. They carry a message that says what was wrong and what is allowed;
//! the binding layer maps them to Python exceptions.

use std::fmt;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
/// What the core and the kernels report instead of panicking; the bindings map each kind to a
/// Python exception.
pub enum Error {
    /// An argument outside what is allowed, or a malformed file. Python sees `ValueError`.
    Value(String),
    /// Reading or writing a file failed. Python sees `OSError` (the subclass its errno picks,
    /// such as `FileNotFoundError`), with `filename` set to `path`.
    Io {
        /// The OS error number, where there is one.
        errno: Option<i32>,
        /// What went wrong.
        message: String,
        /// The file it concerns, where there is one.
        path: Option<PathBuf>,
    },
}

impl Error {
    /// A bad value: ValueError in Python.
    pub fn value(message: impl Into<String>) -> Self {
        Error::Value(message.into())
    }

    /// An I/O error about `path`. The message is the system's, without Rust's "(os error N)".
    pub fn io(err: &std::io::Error, path: Option<&Path>) -> Self {
        let errno = err.raw_os_error();
        let full = err.to_string();
        let message = match errno {
            Some(n) => full
                .strip_suffix(&format!(" (os error {n})"))
                .unwrap_or(&full)
                .to_owned(),
            None => full,
        };
        Error::Io {
            errno,
            message,
            path: path.map(Path::to_path_buf),
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(err: std::io::Error) -> Self {
        Error::io(&err, None)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io {
                message,
                path: Some(path),
                ..
            } => write!(f, "{message}: {}", path.display()),
            Error::Value(message) | Error::Io { message, .. } => f.write_str(message),
        }
    }
}

impl std::error::Error for Error {}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
