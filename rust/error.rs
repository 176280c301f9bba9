//! Errors raised by the core. They carry a message that says what was wrong and what is allowed;
//! the binding layer maps them to Python exceptions.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// An argument outside what is allowed. Python sees `ValueError`.
    Value(String),
}

impl Error {
    pub fn value(message: impl Into<String>) -> Self {
        Error::Value(message.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Value(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;
