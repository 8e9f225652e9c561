//! GGUF metadata values.

use super::reader::Reader;
use freetoken_ggml::Result;

/// One metadata value. Integers keep their signedness; arrays hold one element type.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Smallest encoded size of a value of GGUF type `t` (for bounding array counts).
fn min_size(t: u32) -> usize {
    match t {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        _ => 12, // array: element type + count
    }
}

/// Reads a value of GGUF type `t`; arrays nest at most `depth` levels.
pub fn read_value(r: &mut Reader<'_>, t: u32, key: &str, depth: u32) -> Result<Value> {
    Ok(match t {
        0 => Value::U64(r.u8(key)? as u64),
        1 => Value::I64(r.u8(key)? as i8 as i64),
        2 => Value::U64(r.u16(key)? as u64),
        3 => Value::I64(r.u16(key)? as i16 as i64),
        4 => Value::U64(r.u32(key)? as u64),
        5 => Value::I64(r.u32(key)? as i32 as i64),
        6 => Value::F64(r.f32(key)? as f64),
        7 => match r.u8(key)? {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            b => return Err(r.err(format!("`{key}`: invalid bool byte {b}"))),
        },
        8 => Value::Str(r.string(key)?),
        9 => {
            if depth == 0 {
                return Err(r.err(format!("`{key}`: arrays nested too deeply")));
            }
            let et = r.u32(key)?;
            if et > 12 {
                return Err(r.err(format!("`{key}`: unknown array element type {et}")));
            }
            let n = r.count(min_size(et), key)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(read_value(r, et, key, depth - 1)?);
            }
            Value::Array(items)
        }
        10 => Value::U64(r.u64(key)?),
        11 => Value::I64(r.u64(key)? as i64),
        12 => Value::F64(r.f64(key)?),
        _ => return Err(r.err(format!("`{key}`: unknown value type {t}"))),
    })
}
