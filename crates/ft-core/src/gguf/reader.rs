//! A bounds-checked little-endian cursor over the GGUF header bytes.

use freetoken_ggml::{Error, Result};

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], file: &'a str) -> Reader<'a> {
        Reader { buf, pos: 0, file }
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn err(&self, what: impl std::fmt::Display) -> Error {
        Error::Gguf(format!("{}: {what} (at byte {})", self.file, self.pos))
    }

    pub fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated file: {what} needs {n} bytes, {} left",
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.bytes(N, what)?.try_into().expect("length checked"))
    }

    pub fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    pub fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    pub fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    pub fn f32(&mut self, what: &str) -> Result<f32> {
        Ok(f32::from_le_bytes(self.array(what)?))
    }
    pub fn f64(&mut self, what: &str) -> Result<f64> {
        Ok(f64::from_le_bytes(self.array(what)?))
    }

    /// A count that must fit in the bytes left, given each item takes at least `min_item`.
    pub fn count(&mut self, min_item: usize, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        let fits = (n as u128) * (min_item.max(1) as u128) <= self.remaining() as u128;
        if !fits {
            return Err(self.err(format!(
                "{what} is {n}, more than the {} bytes left can hold",
                self.remaining()
            )));
        }
        Ok(n as usize)
    }

    pub fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(1, what)?;
        let b = self.bytes(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err(format!("{what} is not UTF-8")))
    }
}
