//! The project's one error type. Every crate returns it; `ft-py` maps each kind to one
//! `freetoken.errors` class in one place.

use std::fmt;

/// What went wrong, by kind; the message names the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A type, architecture or feature this build does not handle.
    Unsupported(String),
    /// Sizes or shapes that do not fit together.
    Shape(String),
    /// A value that is not acceptable (NaN input, a missing importance matrix, ...).
    InvalidInput(String),
    /// A GGUF file that is corrupt, truncated or inconsistent.
    Gguf(String),
    /// An operating-system error (open, map, read).
    Io(String),
    /// An allocation that could not be satisfied.
    OutOfMemory(String),
    /// The GPU failed: a kernel launch, a lost device, a driver error.
    Device(String),
}

impl Error {
    /// The message without the kind.
    pub fn message(&self) -> &str {
        match self {
            Error::Unsupported(m)
            | Error::Shape(m)
            | Error::InvalidInput(m)
            | Error::Gguf(m)
            | Error::Io(m)
            | Error::OutOfMemory(m)
            | Error::Device(m) => m,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

/// Result with the project's error.
pub type Result<T> = std::result::Result<T, Error>;
