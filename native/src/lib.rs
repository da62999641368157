//! JSON and Avro source values -> PostgreSQL binary COPY, the PostgreSQL sink's optional fast path.
//!
//! The contract that keeps this exact: [`CopyEncoder::encode`] takes a record only when it is
//! certain that the Python path -- `orjson.loads`, the sink's converters
//! (`participants/sinks/_pgtypes.py`) and psycopg's binary dumpers -- would store exactly the
//! same values. Every other record is handed back by index and takes the Python path, which
//! decides everything else: other accepted spellings, rejections and their reasons, dead
//! letters for what is not JSON. Being unsure is never wrong here, only slower; so anything
//! unusual (a null or missing field, an escape in a timestamp, a float in a text column, a
//! 19-digit integer anywhere, a duplicated key) is handed back rather than modelled.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::intern;
use pyo3::types::{PyBytes, PyList, PyString};
use apache_avro::types::Value as AvroValue;
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::{Arc, RwLock};

/// Binary COPY header: signature, flags (0), header extension length (0).
const HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";
const TRAILER: &[u8] = b"\xff\xff";
/// Python's float4 range check (`_pgtypes._FLOAT4_MAX`, f32::MAX widened).
const FLOAT4_MAX: f64 = 3.4028234663852886e38;
/// Days from 1970-01-01 to 2000-01-01, PostgreSQL's epoch.
const PG_EPOCH_DAYS: i64 = 10957;
/// Deeper nesting is handed back (orjson allows more; the Python path decides).
const MAX_DEPTH: u32 = 64;
/// Integer literals longer than this are handed back: orjson reads wider ones as floats.
const MAX_INT_DIGITS: usize = 18;
/// Wider tables take the Python path.
const MAX_COLUMNS: usize = 64;
/// Float literals longer than this are handed back (extreme exponents, long mantissas).
const MAX_FLOAT_LEN: usize = 40;

#[derive(Clone, Copy, Debug)]
enum Kind {
    Int2,
    Int4,
    Int8,
    Float4,
    Float8,
    Numeric,
    Bool,
    Text(Option<usize>),
    Timestamptz,
    Timestamp,
    Date,
    Uuid,
}

impl Kind {
    fn from_type(base: &str, max_length: Option<usize>) -> Option<Kind> {
        Some(match base {
            "int2" => Kind::Int2,
            "int4" => Kind::Int4,
            "int8" => Kind::Int8,
            "float4" => Kind::Float4,
            "float8" => Kind::Float8,
            "numeric" => Kind::Numeric,
            "bool" => Kind::Bool,
            "text" | "varchar" | "bpchar" | "name" => Kind::Text(max_length),
            "timestamptz" => Kind::Timestamptz,
            "timestamp" => Kind::Timestamp,
            "date" => Kind::Date,
            "uuid" => Kind::Uuid,
            _ => return None,
        })
    }
}

/// One captured top-level value of a mapped field.
#[derive(Clone, Copy)]
enum Tok<'a> {
    Absent,
    Null,
    True,
    False,
    /// The bytes between the quotes; `escaped` when they hold a backslash.
    Str(&'a [u8], bool),
    Int(i64),
    Float(f64),
    Composite,
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

fn hex4(s: &[u8]) -> Option<u32> {
    if s.len() < 4 {
        return None;
    }
    let mut v = 0u32;
    for &b in &s[..4] {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => return None,
        };
        v = v * 16 + d as u32;
    }
    Some(v)
}

/// Whether any of the eight bytes of `word` is a quote, a backslash or a control character
/// (below 0x20): the bytes a JSON string's scan must stop at. Exact (no byte is reported that
/// is not there: SWAR zero and less-than tests, whose borrows only ever follow a true hit).
#[inline]
fn has_special(word: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let zero_in = |v: u64| v.wrapping_sub(ONES) & !v & HIGHS;
    let quote = zero_in(word ^ (ONES * b'"' as u64));
    let backslash = zero_in(word ^ (ONES * b'\\' as u64));
    let control = word.wrapping_sub(ONES * 0x20) & !word & HIGHS;
    quote | backslash | control != 0
}

impl<'a> Parser<'a> {
    /// A parser inside the top-level object of `doc` (its opening brace consumed); None when
    /// `doc` is not valid UTF-8 (orjson refuses it) or does not start with an object.
    fn object(doc: &'a [u8]) -> Option<Parser<'a>> {
        std::str::from_utf8(doc).ok()?;
        let mut p = Parser { s: doc, i: 0 };
        p.ws();
        if p.s.get(p.i) != Some(&b'{') {
            return None;
        }
        p.i += 1;
        Some(p)
    }

    /// Whether only whitespace is left.
    fn at_end(&mut self) -> bool {
        self.ws();
        self.i == self.s.len()
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(&b) = self.s.get(self.i) {
            if b == b' ' || b == b'\n' || b == b'\r' || b == b'\t' {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    /// A string whose opening quote was consumed: its raw bytes and whether it has escapes.
    /// Strict like orjson: control characters and lone surrogates are errors.
    fn string(&mut self) -> Option<(&'a [u8], bool)> {
        let start = self.i;
        let mut escaped = false;
        loop {
            // Eight bytes at a time past the plain ones (no quote, backslash or control).
            while let Some(word) = self.s.get(self.i..self.i + 8) {
                if has_special(u64::from_le_bytes(word.try_into().ok()?)) {
                    break;
                }
                self.i += 8;
            }
            let b = *self.s.get(self.i)?;
            match b {
                b'"' => {
                    let raw = &self.s[start..self.i];
                    self.i += 1;
                    return Some((raw, escaped));
                }
                b'\\' => {
                    escaped = true;
                    let e = *self.s.get(self.i + 1)?;
                    match e {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.i += 2,
                        b'u' => {
                            let cp = hex4(self.s.get(self.i + 2..)?)?;
                            self.i += 6;
                            if (0xDC00..=0xDFFF).contains(&cp) {
                                return None;
                            }
                            if (0xD800..=0xDBFF).contains(&cp) {
                                if self.s.get(self.i) != Some(&b'\\')
                                    || self.s.get(self.i + 1) != Some(&b'u')
                                {
                                    return None;
                                }
                                let low = hex4(self.s.get(self.i + 2..)?)?;
                                if !(0xDC00..=0xDFFF).contains(&low) {
                                    return None;
                                }
                                self.i += 6;
                            }
                        }
                        _ => return None,
                    }
                }
                0..=0x1f => return None,
                _ => self.i += 1,
            }
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while let Some(b'0'..=b'9') = self.s.get(self.i) {
            self.i += 1;
        }
        self.i - start
    }

    fn number(&mut self) -> Option<Tok<'a>> {
        let start = self.i;
        let neg = self.s.get(self.i) == Some(&b'-');
        if neg {
            self.i += 1;
        }
        match self.s.get(self.i)? {
            b'0' => self.i += 1,
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        let int_end = self.i;
        let mut is_int = true;
        if self.s.get(self.i) == Some(&b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return None;
            }
            is_int = false;
        }
        if let Some(b'e' | b'E') = self.s.get(self.i) {
            self.i += 1;
            if let Some(b'+' | b'-') = self.s.get(self.i) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return None;
            }
            is_int = false;
        }
        if is_int {
            let digits = &self.s[start + neg as usize..int_end];
            if digits.len() > MAX_INT_DIGITS {
                return None;
            }
            let mut v: i64 = 0;
            for &d in digits {
                v = v * 10 + (d - b'0') as i64;
            }
            return Some(Tok::Int(if neg { -v } else { v }));
        }
        let text = &self.s[start..self.i];
        if text.len() > MAX_FLOAT_LEN {
            return None;
        }
        // SAFETY-free: the literal is ASCII, checked by the grammar above.
        let v: f64 = std::str::from_utf8(text).ok()?.parse().ok()?;
        if !v.is_finite() {
            return None; // orjson: "number is infinity when parsed as double"
        }
        Some(Tok::Float(v))
    }

    fn literal(&mut self, word: &[u8], tok: Tok<'a>) -> Option<Tok<'a>> {
        if self.s.get(self.i..self.i + word.len())? == word {
            self.i += word.len();
            Some(tok)
        } else {
            None
        }
    }

    fn value(&mut self, depth: u32) -> Option<Tok<'a>> {
        match *self.s.get(self.i)? {
            b'"' => {
                self.i += 1;
                let (raw, escaped) = self.string()?;
                Some(Tok::Str(raw, escaped))
            }
            b'{' => {
                self.i += 1;
                self.object_body(depth + 1)?;
                Some(Tok::Composite)
            }
            b'[' => {
                self.i += 1;
                self.array_body(depth + 1)?;
                Some(Tok::Composite)
            }
            b't' => self.literal(b"true", Tok::True),
            b'f' => self.literal(b"false", Tok::False),
            b'n' => self.literal(b"null", Tok::Null),
            _ => self.number(),
        }
    }

    /// The members of a nested object (opening brace consumed), validated and dropped.
    fn object_body(&mut self, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        if self.s.get(self.i) == Some(&b'}') {
            self.i += 1;
            return Some(());
        }
        loop {
            self.ws();
            if self.s.get(self.i) != Some(&b'"') {
                return None;
            }
            self.i += 1;
            self.string()?;
            self.ws();
            if self.s.get(self.i) != Some(&b':') {
                return None;
            }
            self.i += 1;
            self.ws();
            self.value(depth)?;
            self.ws();
            match self.s.get(self.i)? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    fn array_body(&mut self, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        if self.s.get(self.i) == Some(&b']') {
            self.i += 1;
            return Some(());
        }
        loop {
            self.ws();
            self.value(depth)?;
            self.ws();
            match self.s.get(self.i)? {
                b',' => self.i += 1,
                b']' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }
}

/// The text of a JSON string's raw bytes (escapes resolved) into `out`.
fn unescape(raw: &[u8], out: &mut Vec<u8>) -> Option<()> {
    out.clear();
    let mut i = 0;
    while i < raw.len() {
        let b = raw[i];
        if b != b'\\' {
            out.push(b);
            i += 1;
            continue;
        }
        let e = raw[i + 1];
        i += 2;
        let c = match e {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let mut cp = hex4(&raw[i..])?;
                i += 4;
                if (0xD800..=0xDBFF).contains(&cp) {
                    let low = hex4(&raw[i + 2..])?; // validated by the parser: \uDC00-\uDFFF
                    i += 6;
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                }
                char::from_u32(cp)?
            }
            _ => return None,
        };
        let mut buf = [0u8; 4];
        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
    }
    Some(())
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146097 + doe - 719468
}

fn num(s: &[u8]) -> Option<i64> {
    let mut v = 0i64;
    for &b in s {
        if !b.is_ascii_digit() {
            return None;
        }
        v = v * 10 + (b - b'0') as i64;
    }
    Some(v)
}

/// `YYYY-MM-DD`, strictly, as days since 2000-01-01. Years 1 and 9999 are handed back (the
/// Python path's range handling at the edges is its own).
fn parse_date(s: &[u8]) -> Option<i64> {
    if s.len() < 10 || s[4] != b'-' || s[7] != b'-' {
        return None;
    }
    let (y, m, d) = (num(&s[0..4])?, num(&s[5..7])?, num(&s[8..10])?);
    if !(2..=9998).contains(&y) || !(1..=12).contains(&m) || d < 1 || d > days_in_month(y, m) {
        return None;
    }
    Some(days_from_civil(y, m, d) - PG_EPOCH_DAYS)
}

/// `YYYY-MM-DD[T ]HH:MM:SS[.f{1,6}][Z|+HH:MM|-HH:MM]`, strictly: microseconds since
/// 2000-01-01 00:00 UTC, a value without an offset read as UTC (as the Python converters do).
fn parse_timestamp(s: &[u8]) -> Option<i64> {
    if s.len() < 19 || (s[10] != b'T' && s[10] != b' ') || s[13] != b':' || s[16] != b':' {
        return None;
    }
    let days = parse_date(&s[..10])?;
    let (h, mi, sec) = (num(&s[11..13])?, num(&s[14..16])?, num(&s[17..19])?);
    if h > 23 || mi > 59 || sec > 59 {
        return None;
    }
    let mut i = 19;
    let mut micros = 0i64;
    if s.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while let Some(b'0'..=b'9') = s.get(i) {
            i += 1;
        }
        let n = i - start;
        if n == 0 || n > 6 {
            return None;
        }
        micros = num(&s[start..i])? * 10i64.pow((6 - n) as u32);
    }
    let mut offset_s = 0i64;
    match s.get(i) {
        None => {}
        Some(b'Z') if i + 1 == s.len() => {}
        Some(&sign @ (b'+' | b'-')) if s.len() == i + 6 && s[i + 3] == b':' => {
            let (oh, om) = (num(&s[i + 1..i + 3])?, num(&s[i + 4..i + 6])?);
            if oh > 23 || om > 59 {
                return None;
            }
            offset_s = (oh * 3600 + om * 60) * if sign == b'-' { -1 } else { 1 };
        }
        _ => return None,
    }
    Some((days * 86400 + h * 3600 + mi * 60 + sec - offset_s) * 1_000_000 + micros)
}

fn parse_uuid(s: &[u8], out: &mut [u8; 16]) -> Option<()> {
    if s.len() != 36 || s[8] != b'-' || s[13] != b'-' || s[18] != b'-' || s[23] != b'-' {
        return None;
    }
    let mut k = 0;
    let mut i = 0;
    while i < 36 {
        if i == 8 || i == 13 || i == 18 || i == 23 {
            i += 1;
            continue;
        }
        let hi = (s[i] as char).to_digit(16)?;
        let lo = (s[i + 1] as char).to_digit(16)?;
        out[k] = (hi * 16 + lo) as u8;
        k += 1;
        i += 2;
    }
    Some(())
}

/// The decimal digits of `v`, written at the end of `buf`.
fn decimal_digits(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &buf[i..];
        }
    }
}

#[inline]
fn put_len(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&(n as i32).to_be_bytes());
}

/// PostgreSQL binary numeric of `digits` x 10^`exp10` (digits: ASCII, no sign) with display
/// scale `dscale` -- the value and scale psycopg sends for the same Python Decimal.
fn put_numeric(out: &mut Vec<u8>, neg: bool, digits: &[u8], exp10: i32, dscale: i32) {
    let first_nonzero = digits.iter().position(|&d| d != b'0');
    let Some(skip) = first_nonzero else {
        put_len(out, 8);
        out.extend_from_slice(&0i16.to_be_bytes()); // ndigits
        out.extend_from_slice(&0i16.to_be_bytes()); // weight
        out.extend_from_slice(&0u16.to_be_bytes()); // sign: zero is positive
        out.extend_from_slice(&(dscale as u16).to_be_bytes());
        return;
    };
    let digits = &digits[skip..];
    let first_pow = digits.len() as i32 + exp10 - 1;
    let weight = first_pow.div_euclid(4);
    let last_group = exp10.div_euclid(4);
    let mut groups = [0u16; 96]; // |exponent| <= 400 and <= 40 digits: well inside
    let ngroups = (weight - last_group + 1) as usize;
    for (k, &d) in digits.iter().enumerate() {
        let p = first_pow - k as i32;
        let g = (weight - p.div_euclid(4)) as usize;
        groups[g] += (d - b'0') as u16 * 10u16.pow(p.rem_euclid(4) as u32);
    }
    let mut n = ngroups;
    while n > 0 && groups[n - 1] == 0 {
        n -= 1;
    }
    put_len(out, 8 + 2 * n);
    out.extend_from_slice(&(n as i16).to_be_bytes());
    out.extend_from_slice(&(weight as i16).to_be_bytes());
    out.extend_from_slice(&(if neg { 0x4000u16 } else { 0 }).to_be_bytes());
    out.extend_from_slice(&(dscale as u16).to_be_bytes());
    for g in &groups[..n] {
        out.extend_from_slice(&g.to_be_bytes());
    }
}

/// `Decimal(text)` as numeric, for the plain spelling only: `-?DIGITS(.DIGITS)?` (what Debezium's
/// `decimal.handling.mode: string` and the registry decoder's decimals write), at most 40
/// significant digits and 100 after the point; anything else (exponents, spaces, `NaN`, a
/// negative zero) is handed back to `Decimal` itself.
fn put_text_numeric(out: &mut Vec<u8>, raw: &[u8]) -> Option<()> {
    let (neg, body) = match raw.first()? {
        b'-' => (true, &raw[1..]),
        _ => (false, raw),
    };
    let (int, frac) = match body.iter().position(|&b| b == b'.') {
        Some(dot) => (&body[..dot], &body[dot + 1..]),
        None => (body, &body[..0]),
    };
    if int.is_empty()
        || (frac.is_empty() && body.len() != int.len())
        || !int.iter().chain(frac).all(u8::is_ascii_digit)
        || frac.len() > 100
    {
        return None;
    }
    let mut digits = [0u8; 140];
    let all = int.len() + frac.len();
    let lead = int.iter().take_while(|&&d| d == b'0').count();
    if all - lead > 40 || all > digits.len() {
        return None;
    }
    digits[..int.len()].copy_from_slice(int);
    digits[int.len()..all].copy_from_slice(frac);
    if neg && digits[..all].iter().all(|&d| d == b'0') {
        return None; // Decimal("-0.0") keeps its sign: Python decides
    }
    let scale = frac.len() as i32;
    put_numeric(out, neg, &digits[lead.min(all - 1)..all], -scale, scale);
    Some(())
}

/// `Decimal(repr(x))` as numeric: Python's repr gives the shortest round-trip digits, in fixed
/// notation with a trailing ".0" when -4 < decpt <= 16 (decpt: value = 0.DIGITS x 10^decpt),
/// in exponent notation otherwise. Rust's `{:e}` gives the same shortest digits, except for
/// an exact tie between two of them ([`is_exact_tie`]): such values are handed back.
fn put_float_numeric(out: &mut Vec<u8>, x: f64, scratch: &mut String) -> Option<()> {
    if x == 0.0 {
        put_numeric(out, false, b"0", 0, 1); // "0.0" (and "-0.0": PostgreSQL has no -0)
        return Some(());
    }
    scratch.clear();
    write!(scratch, "{:e}", x.abs()).ok()?;
    let (mantissa, exp) = scratch.split_once('e')?;
    let e: i32 = exp.parse().ok()?;
    let mut digits = [0u8; 24];
    let mut n = 0;
    for b in mantissa.bytes() {
        if b != b'.' {
            *digits.get_mut(n)? = b;
            n += 1;
        }
    }
    if n >= 14 && is_exact_tie(x.abs(), n, scratch)? {
        return None;
    }
    let decpt = e + 1;
    let exp10 = decpt - n as i32;
    let fixed = -4 < decpt && decpt <= 16;
    let dscale = if fixed && n as i32 <= decpt { 1 } else { (-exp10).max(0) };
    put_numeric(out, x < 0.0, &digits[..n], exp10, dscale);
    Some(())
}

/// True when `x` lies exactly halfway between two `n`-digit decimals. Then both round-trip and
/// the shortest representation is a tie: Python's repr picks the even last digit, Rust's
/// formatter rounds up (70368744177664.125: Python "...664.12", Rust "...664.13"). That needs
/// an exact expansion of `n` + 1 significant digits ending in 5, and the two candidates are one
/// ulp apart only from ~16 digits on (callers check from 14).
fn is_exact_tie(x: f64, n: usize, scratch: &mut String) -> Option<bool> {
    scratch.clear();
    write!(scratch, "{:.40e}", x).ok()?; // exact to 41 significant digits: "d.ddd...e7"
    let (mantissa, _) = scratch.split_once('e')?;
    let significant = mantissa.trim_end_matches('0');
    let count = significant.len() - significant.contains('.') as usize;
    Some(count == n + 1 && significant.ends_with('5'))
}

struct Scratch {
    text: Vec<u8>,
    fmt: String,
}

/// Column `kind` from `tok` into `out`; None: hand the record back.
fn put_value(out: &mut Vec<u8>, kind: Kind, tok: Tok, scratch: &mut Scratch) -> Option<()> {
    match (kind, tok) {
        (Kind::Int8, Tok::Int(v)) => {
            put_len(out, 8);
            out.extend_from_slice(&v.to_be_bytes());
        }
        (Kind::Int4, Tok::Int(v)) => {
            let v = i32::try_from(v).ok()?;
            put_len(out, 4);
            out.extend_from_slice(&v.to_be_bytes());
        }
        (Kind::Int2, Tok::Int(v)) => {
            let v = i16::try_from(v).ok()?;
            put_len(out, 2);
            out.extend_from_slice(&v.to_be_bytes());
        }
        (Kind::Float8 | Kind::Float4, Tok::Int(_) | Tok::Float(_)) => {
            let x = match tok {
                Tok::Int(v) => v as f64, // float(int): round to nearest, and -0 is 0
                Tok::Float(x) => x,
                _ => return None,
            };
            if let Kind::Float4 = kind {
                if x.abs() > FLOAT4_MAX || (x != 0.0 && (x as f32) == 0.0) {
                    return None; // out of real's range, or rounding to 0: Python refuses it
                }
                put_len(out, 4);
                out.extend_from_slice(&(x as f32).to_be_bytes());
            } else {
                put_len(out, 8);
                out.extend_from_slice(&x.to_be_bytes());
            }
        }
        (Kind::Numeric, Tok::Int(v)) => {
            let mut buf = [0u8; 20];
            put_numeric(out, v < 0, decimal_digits(v.unsigned_abs(), &mut buf), 0, 0);
        }
        (Kind::Numeric, Tok::Float(x)) => put_float_numeric(out, x, &mut scratch.fmt)?,
        (Kind::Numeric, Tok::Str(raw, false)) => put_text_numeric(out, raw)?,
        (Kind::Bool, Tok::True | Tok::False) => {
            put_len(out, 1);
            out.push(matches!(tok, Tok::True) as u8);
        }
        (Kind::Text(max), Tok::Str(raw, escaped)) => {
            let text: &[u8] = if escaped {
                unescape(raw, &mut scratch.text)?;
                &scratch.text
            } else {
                raw
            };
            if text.contains(&0) {
                return None;
            }
            if let Some(max) = max {
                // Characters, as Python's len() and PostgreSQL's varchar(n) count them.
                if text.len() > max && text.iter().filter(|&&b| b & 0xC0 != 0x80).count() > max
                {
                    return None;
                }
            }
            put_len(out, text.len());
            out.extend_from_slice(text);
        }
        (Kind::Text(max), Tok::True | Tok::False | Tok::Int(_)) => {
            scratch.fmt.clear();
            match tok {
                Tok::True => scratch.fmt.push_str("true"),
                Tok::False => scratch.fmt.push_str("false"),
                Tok::Int(v) => write!(scratch.fmt, "{v}").ok()?,
                _ => return None,
            }
            if max.is_some_and(|m| scratch.fmt.len() > m) {
                return None;
            }
            put_len(out, scratch.fmt.len());
            out.extend_from_slice(scratch.fmt.as_bytes());
        }
        (Kind::Timestamptz | Kind::Timestamp, Tok::Str(raw, false)) => {
            let micros = parse_timestamp(raw)?;
            put_len(out, 8);
            out.extend_from_slice(&micros.to_be_bytes());
        }
        (Kind::Date, Tok::Str(raw, false)) => {
            if raw.len() != 10 {
                return None;
            }
            let days = i32::try_from(parse_date(raw)?).ok()?;
            put_len(out, 4);
            out.extend_from_slice(&days.to_be_bytes());
        }
        (Kind::Uuid, Tok::Str(raw, false)) => {
            let mut bytes = [0u8; 16];
            parse_uuid(raw, &mut bytes)?;
            put_len(out, 16);
            out.extend_from_slice(&bytes);
        }
        _ => return None,
    }
    Some(())
}

/// The members of an object whose opening brace was consumed: `f` gets each member's name
/// (escapes resolved) with the parser at its value, and must consume the value. None: not a
/// well-formed object (or `f` said no).
fn members<'a>(
    p: &mut Parser<'a>,
    mut f: impl FnMut(&[u8], &mut Parser<'a>) -> Option<()>,
) -> Option<()> {
    p.ws();
    if p.s.get(p.i) == Some(&b'}') {
        p.i += 1;
        return Some(());
    }
    let mut unescaped = Vec::new();
    loop {
        p.ws();
        if p.s.get(p.i) != Some(&b'"') {
            return None;
        }
        p.i += 1;
        let (key, escaped) = p.string()?;
        let key: &[u8] = if escaped {
            unescape(key, &mut unescaped)?;
            &unescaped
        } else {
            key
        };
        p.ws();
        if p.s.get(p.i) != Some(&b':') {
            return None;
        }
        p.i += 1;
        p.ws();
        f(key, p)?;
        p.ws();
        match p.s.get(p.i)? {
            b',' => p.i += 1,
            b'}' => {
                p.i += 1;
                return Some(());
            }
            _ => return None,
        }
    }
}

/// Two captured values that decode to the same Python value (a record key's field against
/// the row's: the Python path lets the key's win, so they must not differ).
fn same(a: Tok, b: Tok) -> bool {
    match (a, b) {
        (Tok::Str(x, ex), Tok::Str(y, ey)) => x == y && ex == ey,
        (Tok::Int(x), Tok::Int(y)) => x == y,
        (Tok::Float(x), Tok::Float(y)) => x.to_bits() == y.to_bits(),
        (Tok::True, Tok::True) | (Tok::False, Tok::False) => true,
        _ => false,
    }
}

/// A change event around the row (Debezium's `{before, after, op, source, ...}`): the row is
/// the object in member `row_in`, taken only when member `op` is one of `ops`; with
/// `delete_in`, an event whose `op` is `d` is the delete of the key in that member's object.
struct Envelope {
    row_in: Vec<u8>,
    ops: Vec<Vec<u8>>,
    delete_in: Option<Vec<u8>>,
}

/// Encodes JSON objects into binary COPY rows of one table's mapped columns.
#[pyclass(frozen, module = "twophase_native")]
struct CopyEncoder {
    fields: Vec<Vec<u8>>,
    kinds: Vec<Kind>,
    envelope: Option<Envelope>,
    /// Each row starts with two more columns: its value's index (int8) and whether it is a
    /// delete (bool), for rows applied in order.
    seq: bool,
    /// The key columns: the only ones a delete's row holds (the others are NULL).
    key_columns: Vec<bool>,
}

type Caps<'a> = [Tok<'a>; MAX_COLUMNS];

impl CopyEncoder {
    /// The mapped fields of an object whose opening brace was consumed, into `caps`.
    fn capture<'a>(&self, p: &mut Parser<'a>, caps: &mut Caps<'a>) -> Option<()> {
        members(p, |key, p| {
            let tok = p.value(1)?;
            // One field may feed several columns.
            for j in (0..self.fields.len()).filter(|&j| self.fields[j] == key) {
                if !matches!(caps[j], Tok::Absent) {
                    return None; // a duplicated key: the Python path keeps the last one
                }
                caps[j] = tok;
            }
            Some(())
        })
    }

    /// The row of a change event (`op` one of the envelope's, its row an object) into `caps`:
    /// Some(false); or with `delete_in`, the object a delete (`op` `d`) names: Some(true).
    fn capture_event<'a>(&self, env: &Envelope, p: &mut Parser<'a>, caps: &mut Caps<'a>) -> Option<bool> {
        let mut op: Option<Tok<'a>> = None;
        let mut row_seen = false;
        let mut row_taken = false;
        // Where the delete's object is: read only once `op` says it is a delete.
        let mut deleted_at: Option<(usize, usize)> = None;
        let mut deleted_seen = false;
        let doc: &'a [u8] = p.s;
        members(p, |key, p| {
            if key == env.row_in.as_slice() {
                if row_seen {
                    return None; // duplicated: the Python path keeps the last one
                }
                row_seen = true;
                if p.s.get(p.i) == Some(&b'{') {
                    p.i += 1;
                    self.capture(p, caps)?;
                    row_taken = true;
                } else {
                    p.value(1)?; // null (a delete) or not a row: the Python path says which
                }
            } else if env.delete_in.as_deref() == Some(key) {
                if deleted_seen {
                    return None;
                }
                deleted_seen = true;
                let start = p.i;
                p.value(1)?;
                deleted_at = Some((start, p.i));
            } else if key == b"op" {
                if op.is_some() {
                    return None;
                }
                op = Some(p.value(1)?);
            } else {
                p.value(1)?;
            }
            Some(())
        })?;
        match op? {
            Tok::Str(raw, false) if row_taken && env.ops.iter().any(|o| o.as_slice() == raw) => {
                Some(false)
            }
            Tok::Str(b"d", false) if !row_taken => {
                // A delete whose object is not one (null, a scalar): the Python path says why.
                let (start, end) = deleted_at?;
                let mut q = Parser { s: &doc[..end], i: start };
                q.ws();
                if q.s.get(q.i) != Some(&b'{') {
                    return None;
                }
                q.i += 1;
                self.capture(&mut q, caps)?;
                Some(true)
            }
            _ => None,
        }
    }

    /// Every member of the record key `key` (a JSON object of scalars) that feeds a column
    /// holds the same value in the row.
    fn key_agrees(&self, key: &[u8], caps: &Caps) -> Option<()> {
        let mut p = Parser::object(key)?;
        let mut count = 0;
        let mut envelope_names = 0;
        members(&mut p, |name, p| {
            count += 1;
            if name == b"schema" || name == b"payload" {
                envelope_names += 1;
            }
            let tok = p.value(1)?;
            if matches!(tok, Tok::Null | Tok::Composite) {
                return None;
            }
            for j in (0..self.fields.len()).filter(|&j| self.fields[j] == name) {
                if !same(caps[j], tok) {
                    return None;
                }
            }
            Some(())
        })?;
        // A Kafka Connect envelope ({schema, payload}) is unwrapped by the Python path.
        (p.at_end() && !(count == 2 && envelope_names == 2)).then_some(())
    }

    /// One record's row appended to `out`, or None (and `out` as it was).
    fn row(&self, index: usize, doc: &[u8], key: Option<&[u8]>, out: &mut Vec<u8>, scratch: &mut Scratch) -> Option<()> {
        let mut p = Parser::object(doc)?; // orjson refuses invalid UTF-8; so do we
        let mut caps: Caps = [Tok::Absent; MAX_COLUMNS];
        let deleted = match &self.envelope {
            None => {
                self.capture(&mut p, &mut caps)?;
                false
            }
            Some(env) => self.capture_event(env, &mut p, &mut caps)?,
        };
        if !p.at_end() {
            return None;
        }
        if let Some(key) = key {
            self.key_agrees(key, &caps)?;
        }
        let start = out.len();
        let extra = if self.seq { 2 } else { 0 };
        out.extend_from_slice(&((self.kinds.len() + extra) as i16).to_be_bytes());
        if self.seq {
            put_len(out, 8);
            out.extend_from_slice(&(index as i64).to_be_bytes());
            put_len(out, 1);
            out.push(deleted as u8);
        }
        for (j, &kind) in self.kinds.iter().enumerate() {
            if deleted && !self.key_columns[j] {
                out.extend_from_slice(&(-1i32).to_be_bytes()); // NULL: a delete needs its key only
                continue;
            }
            let tok = caps[j];
            if matches!(tok, Tok::Absent | Tok::Null | Tok::Composite) || put_value(out, kind, tok, scratch).is_none() {
                out.truncate(start);
                return None;
            }
        }
        Some(())
    }

    fn encode_all(&self, docs: &[&[u8]], keys: Option<&[Option<&[u8]>]>) -> (Vec<u8>, Vec<usize>) {
        stream(docs, |i, doc, out, scratch| match keys {
            // A record without a key: the Python path says why it cannot be one.
            Some(keys) => keys[i].and_then(|k| self.row(i, doc, Some(k), out, scratch)),
            None => self.row(i, doc, None, out, scratch),
        })
    }
}

/// The binary COPY stream of the rows `row` takes (b"" when none), and the indices of the
/// values it handed back.
fn stream(
    docs: &[&[u8]],
    mut row: impl FnMut(usize, &[u8], &mut Vec<u8>, &mut Scratch) -> Option<()>,
) -> (Vec<u8>, Vec<usize>) {
    let mut out = Vec::with_capacity(docs.iter().map(|d| d.len() * 2).sum::<usize>() + 64);
    out.extend_from_slice(HEADER);
    let mut handed_back = Vec::new();
    let mut scratch = Scratch { text: Vec::new(), fmt: String::new() };
    for (i, doc) in docs.iter().enumerate() {
        if row(i, doc, &mut out, &mut scratch).is_none() {
            handed_back.push(i);
        }
    }
    if handed_back.len() == docs.len() {
        out.clear();
    } else {
        out.extend_from_slice(TRAILER);
    }
    (out, handed_back)
}

/// Per target column, in COPY order, (field, base type, max length): the fields and kinds.
fn columns_of(columns: Vec<(String, String, Option<usize>)>) -> PyResult<(Vec<String>, Vec<Kind>)> {
    let mut fields = Vec::new();
    let mut kinds = Vec::new();
    for (field, base, max_length) in columns {
        let kind = Kind::from_type(&base, max_length)
            .ok_or_else(|| PyValueError::new_err(format!("type {base} is not handled")))?;
        fields.push(field);
        kinds.push(kind);
    }
    if kinds.is_empty() || kinds.len() > MAX_COLUMNS {
        return Err(PyValueError::new_err(format!("1 to {MAX_COLUMNS} columns")));
    }
    Ok((fields, kinds))
}

/// The bytes objects of a Python list (kept alive, and immutable, while their bytes are read).
fn bytes_of<'py>(values: &Bound<'py, PyList>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    values.iter().map(|v| v.cast_into::<PyBytes>().map_err(PyErr::from)).collect()
}

#[pymethods]
impl CopyEncoder {
    /// `columns`: per target column, in COPY order, (JSON field, base type, max length).
    /// `row_in` and `ops`: the values are change events whose row is the object in member
    /// `row_in`, taken when member `op` is one of `ops`. `seq`: each row starts with its
    /// value's index (int8) and whether it is a delete (bool). `delete_in` (with `seq` and
    /// `key_columns`, one flag per column): an event whose `op` is `d` is a delete, its row
    /// the key columns of the object in member `delete_in` and NULL in every other column.
    /// Raises ValueError naming a type this encoder does not handle.
    #[new]
    #[pyo3(signature = (columns, row_in=None, ops=None, seq=false, delete_in=None, key_columns=None))]
    fn new(
        columns: Vec<(String, String, Option<usize>)>,
        row_in: Option<String>,
        ops: Option<Vec<String>>,
        seq: bool,
        delete_in: Option<String>,
        key_columns: Option<Vec<bool>>,
    ) -> PyResult<Self> {
        let (fields, kinds) = columns_of(columns)?;
        let fields = fields.into_iter().map(String::into_bytes).collect();
        let deletes = delete_in.is_some();
        let envelope = match (row_in, ops) {
            (None, None) if !deletes => None,
            (Some(row_in), Some(ops)) if !ops.is_empty() => Some(Envelope {
                row_in: row_in.into_bytes(),
                ops: ops.into_iter().map(String::into_bytes).collect(),
                delete_in: delete_in.map(String::into_bytes),
            }),
            _ => return Err(PyValueError::new_err("row_in and ops go together (and delete_in with them)")),
        };
        let key_columns = match key_columns {
            Some(k) if k.len() == kinds.len() && k.iter().any(|&b| b) => k,
            None if !deletes => vec![true; kinds.len()],
            _ => return Err(PyValueError::new_err("delete_in needs key_columns: one flag per column, one set at least")),
        };
        if deletes && !seq {
            return Err(PyValueError::new_err("delete_in needs seq: a delete row is told by its flag"));
        }
        Ok(CopyEncoder { fields, kinds, envelope, seq, key_columns })
    }

    /// Encodes `values` (a list of bytes): returns the complete binary COPY stream of the rows
    /// taken (b"" when none), and the indices of the values handed back to the Python path.
    /// With `keys` (one bytes or None per value: the record keys, JSON objects), a value is
    /// taken only when every key member that feeds a column equals the row's.
    #[pyo3(signature = (values, keys=None))]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        values: &Bound<'py, PyList>,
        keys: Option<&Bound<'py, PyList>>,
    ) -> PyResult<(Bound<'py, PyBytes>, Vec<usize>)> {
        let owned = bytes_of(values)?;
        let docs: Vec<&[u8]> = owned.iter().map(|b| b.as_bytes()).collect();
        let owned_keys: Option<Vec<Option<Bound<'py, PyBytes>>>> = match keys {
            None => None,
            Some(keys) => {
                if keys.len() != docs.len() {
                    return Err(PyValueError::new_err("one key per value"));
                }
                Some(
                    keys.iter()
                        .map(|k| {
                            if k.is_none() {
                                Ok(None)
                            } else {
                                k.cast_into::<PyBytes>().map(Some).map_err(PyErr::from)
                            }
                        })
                        .collect::<PyResult<_>>()?,
                )
            }
        };
        let key_docs: Option<Vec<Option<&[u8]>>> = owned_keys
            .as_ref()
            .map(|ks| ks.iter().map(|k| k.as_ref().map(|b| b.as_bytes())).collect());
        // The lists' bytes objects are immutable and `owned` keeps them alive meanwhile.
        let (out, handed_back) = py.detach(|| self.encode_all(&docs, key_docs.as_deref()));
        Ok((PyBytes::new(py, &out), handed_back))
    }
}

// ---------------------------------------------------------------------------------- Avro

/// Microseconds from 1970-01-01 to 2000-01-01, PostgreSQL's epoch.
const PG_EPOCH_MICROS: i64 = PG_EPOCH_DAYS * 86_400_000_000;
/// The instants Python's datetime holds (years 1 to 9999), in microseconds since 1970.
const MIN_MICROS: i64 = -62_135_596_800_000_000;
const MAX_MICROS: i64 = 253_402_300_799_999_999;
/// The days Python's date holds (years 1 to 9999), since 1970.
const MIN_DAYS: i32 = -719_162;
const MAX_DAYS: i32 = 2_932_896;

use apache_avro::Schema as AvroSchemaOf;

/// One writer schema: the schema, and per column the position of its field in the record and
/// the field's schema.
struct AvroSchema {
    schema: AvroSchemaOf,
    at: Vec<Option<(usize, AvroSchemaOf)>>,
}

/// Column `kind` from an Avro value into `out`; None: hand the record back. The same result
/// as the Python path: fastavro's value, the registry decoder's model (an instant as
/// ISO-8601 UTC text, a date as ISO text, a UUID as its text) and the sink's converters.
fn put_avro(out: &mut Vec<u8>, kind: Kind, value: &AvroValue, schema: &AvroSchemaOf, scratch: &mut Scratch) -> Option<()> {
    let tok = match value {
        AvroValue::Union(i, inner) => {
            let AvroSchemaOf::Union(u) = schema else { return None };
            return put_avro(out, kind, inner, u.variants().get(*i as usize)?, scratch);
        }
        AvroValue::Decimal(d) => {
            // fastavro's Decimal at the schema's scale, stored as its exact text is: the digits
            // of the unscaled value, scale digits after the point.
            let (Kind::Numeric, AvroSchemaOf::Decimal(ds)) = (kind, schema) else { return None };
            let scale = i32::try_from(ds.scale).ok()?;
            let bytes = Vec::<u8>::try_from(d).ok()?;
            let unscaled = num_bigint::BigInt::from_signed_bytes_be(&bytes);
            let digits = unscaled.magnitude().to_string();
            if digits.len() > 40 || scale > 100 {
                return None; // put_numeric's bounds: the Python path takes the rest
            }
            if digits.len() > ds.precision {
                return None; // more digits than its type declares: the Python path refuses it
            }
            put_numeric(out, unscaled.sign() == num_bigint::Sign::Minus, digits.as_bytes(), -scale, scale);
            return Some(());
        }
        AvroValue::Boolean(true) => Tok::True,
        AvroValue::Boolean(false) => Tok::False,
        AvroValue::Int(v) => Tok::Int(*v as i64),
        AvroValue::Long(v) => Tok::Int(*v),
        AvroValue::Float(x) if x.is_finite() => Tok::Float(*x as f64),
        AvroValue::Double(x) if x.is_finite() => Tok::Float(*x),
        AvroValue::String(s) | AvroValue::Enum(_, s) => Tok::Str(s.as_bytes(), false),
        AvroValue::TimestampMillis(ms) => return put_instant(out, kind, ms.checked_mul(1000)?),
        AvroValue::TimestampMicros(us) => return put_instant(out, kind, *us),
        AvroValue::Date(days) => {
            if !matches!(kind, Kind::Date) || !(MIN_DAYS..=MAX_DAYS).contains(days) {
                return None;
            }
            put_len(out, 4);
            out.extend_from_slice(&(*days - PG_EPOCH_DAYS as i32).to_be_bytes());
            return Some(());
        }
        AvroValue::Uuid(u) => {
            match kind {
                Kind::Uuid => {
                    put_len(out, 16);
                    out.extend_from_slice(u.as_bytes());
                }
                Kind::Text(max) => {
                    let text = u.hyphenated().to_string(); // str(UUID): lowercase, hyphenated
                    if max.is_some_and(|m| text.len() > m) {
                        return None;
                    }
                    put_len(out, text.len());
                    out.extend_from_slice(text.as_bytes());
                }
                _ => return None,
            }
            return Some(());
        }
        // Nulls, bytes, fixed, decimals, times of day, local timestamps, nanoseconds,
        // durations and nested values: the Python path.
        _ => return None,
    };
    put_value(out, kind, tok, scratch)
}

/// An instant (microseconds since 1970, UTC) into a timestamp column, as the Python path
/// stores its ISO-8601 UTC text: any other column takes the Python path.
fn put_instant(out: &mut Vec<u8>, kind: Kind, micros: i64) -> Option<()> {
    if !matches!(kind, Kind::Timestamptz | Kind::Timestamp) || !(MIN_MICROS..=MAX_MICROS).contains(&micros) {
        return None;
    }
    put_len(out, 8);
    out.extend_from_slice(&(micros - PG_EPOCH_MICROS).to_be_bytes());
    Some(())
}

/// Encodes values in the schema registry's Avro framing (magic byte 0, a 4-byte schema id, the
/// datum) into binary COPY rows of one table's mapped columns, with the writer schemas the
/// caller gave it (:meth:`add_schema`); a value of any other schema is handed back.
#[pyclass(frozen, module = "twophase_native")]
struct AvroCopyEncoder {
    fields: Vec<String>,
    kinds: Vec<Kind>,
    schemas: RwLock<HashMap<u32, Arc<AvroSchema>>>,
}

impl AvroCopyEncoder {
    fn row(&self, schemas: &HashMap<u32, Arc<AvroSchema>>, doc: &[u8], out: &mut Vec<u8>, scratch: &mut Scratch) -> Option<()> {
        if doc.len() < 5 || doc[0] != 0 {
            return None;
        }
        let id = u32::from_be_bytes([doc[1], doc[2], doc[3], doc[4]]);
        let known = schemas.get(&id)?;
        let mut datum = &doc[5..];
        let AvroValue::Record(fields) = apache_avro::from_avro_datum(&known.schema, &mut datum, None).ok()? else {
            return None;
        };
        let start = out.len();
        out.extend_from_slice(&(self.kinds.len() as i16).to_be_bytes());
        for (j, &kind) in self.kinds.iter().enumerate() {
            let taken = known.at[j].as_ref().and_then(|(k, field_schema)| {
                let (_, value) = fields.get(*k)?;
                put_avro(out, kind, value, field_schema, scratch)
            });
            if taken.is_none() {
                out.truncate(start);
                return None;
            }
        }
        Some(())
    }
}

#[pymethods]
impl AvroCopyEncoder {
    /// `columns`: per target column, in COPY order, (Avro field, base type, max length).
    /// Raises ValueError naming a type this encoder does not handle.
    #[new]
    fn new(columns: Vec<(String, String, Option<usize>)>) -> PyResult<Self> {
        let (fields, kinds) = columns_of(columns)?;
        Ok(AvroCopyEncoder { fields, kinds, schemas: RwLock::new(HashMap::new()) })
    }

    /// Learn the writer schema (Avro's JSON text, without references) of schema id `id`.
    /// ValueError when it cannot be parsed or is not a record.
    fn add_schema(&self, id: u32, schema: &str) -> PyResult<()> {
        let parsed = apache_avro::Schema::parse_str(schema)
            .map_err(|e| PyValueError::new_err(format!("schema {id}: {e}")))?;
        let at = match &parsed {
            apache_avro::Schema::Record(record) => self
                .fields
                .iter()
                .map(|f| record.lookup.get(f).map(|&k| (k, record.fields[k].schema.clone())))
                .collect(),
            _ => return Err(PyValueError::new_err(format!("schema {id} is not a record"))),
        };
        let mut schemas = self.schemas.write().map_err(|_| PyValueError::new_err("poisoned"))?;
        schemas.insert(id, Arc::new(AvroSchema { schema: parsed, at }));
        Ok(())
    }

    /// Whether the writer schema of `id` was given.
    fn knows(&self, id: u32) -> bool {
        self.schemas.read().map(|s| s.contains_key(&id)).unwrap_or(false)
    }

    /// Encodes `values` (a list of bytes): returns the complete binary COPY stream of the rows
    /// taken (b"" when none), and the indices of the values handed back to the Python path.
    fn encode<'py>(
        &self,
        py: Python<'py>,
        values: &Bound<'py, PyList>,
    ) -> PyResult<(Bound<'py, PyBytes>, Vec<usize>)> {
        let owned = bytes_of(values)?;
        let docs: Vec<&[u8]> = owned.iter().map(|b| b.as_bytes()).collect();
        let schemas: HashMap<u32, Arc<AvroSchema>> = self
            .schemas
            .read()
            .map_err(|_| PyValueError::new_err("poisoned"))?
            .clone();
        let (out, handed_back) =
            py.detach(|| stream(&docs, |_, doc, out, scratch| self.row(&schemas, doc, out, scratch)));
        Ok((PyBytes::new(py, &out), handed_back))
    }
}

// ------------------------------------------------------------------------- COPY -> arrays

/// The columns of a binary COPY stream (as [`stream`] makes it; b"" holds no row) of
/// `oids.len()` fields per row, each as one PostgreSQL binary array of one dimension whose
/// elements have type `oids[j]`: what `unnest($1::int8[], ...)` reads back as the same rows,
/// without a table to COPY them into.
#[pyfunction]
fn copy_columns<'py>(py: Python<'py>, payload: &[u8], oids: Vec<u32>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let (cols, _) = py.detach(|| transpose(payload, &oids, &[])).ok_or_else(|| not_a_stream(&oids))?;
    Ok(cols.iter().map(|c| PyBytes::new(py, c)).collect())
}

fn not_a_stream(oids: &[u32]) -> PyErr {
    PyValueError::new_err(format!("not a binary COPY stream of {} fields per row", oids.len()))
}

/// [`copy_columns`] of a stream of change rows (the events encoder's: place in the batch,
/// delete flag, then the columns), and whether a key of `keys` (field indices; every field of
/// the key) has a delete followed by a row -- a key deleted and written again within the
/// stream. Keys are compared by their binary values, so the caller asks only of types whose
/// equal values have equal bytes. Rows out of place order answer true (nothing is assumed).
#[pyfunction]
fn event_columns<'py>(
    py: Python<'py>,
    payload: &[u8],
    oids: Vec<u32>,
    keys: Vec<i64>,
) -> PyResult<(Vec<Bound<'py, PyBytes>>, bool)> {
    let keys: Vec<usize> = keys
        .iter()
        .map(|&k| usize::try_from(k).ok().filter(|&k| k >= 2 && k < oids.len()))
        .collect::<Option<_>>()
        .filter(|k: &Vec<usize>| !k.is_empty())
        .ok_or_else(|| PyValueError::new_err("keys: field indices after the place and the flag"))?;
    let (cols, rewritten) =
        py.detach(|| transpose(payload, &oids, &keys)).ok_or_else(|| not_a_stream(&oids))?;
    Ok((cols.iter().map(|c| PyBytes::new(py, c)).collect(), rewritten))
}

/// Tracks, along a stream of change rows in place order, whether a key is written after a
/// delete of it ([`event_columns`]).
struct Rewrites<'k> {
    keys: &'k [usize],
    deleted: HashSet<Vec<u8>>,
    key: Vec<u8>,
    last_place: Option<i64>,
    found: bool,
}

impl Rewrites<'_> {
    /// One row's fields (each with its 4-byte length; a NULL's is -1 and nothing follows).
    fn row(&mut self, fields: &[&[u8]]) {
        if self.found || self.keys.is_empty() {
            return;
        }
        let place = match <[u8; 8]>::try_from(&fields[0][4..]) {
            Ok(b) => i64::from_be_bytes(b),
            Err(_) => {
                self.found = true; // not a place: assume the worst
                return;
            }
        };
        if self.last_place.is_some_and(|last| place <= last) {
            self.found = true;
            return;
        }
        self.last_place = Some(place);
        let delete = match fields[1].get(4..) {
            Some([0]) => false,
            Some([1]) => true,
            _ => {
                self.found = true; // not a flag the encoder writes: assume the worst
                return;
            }
        };
        if !delete && self.deleted.is_empty() {
            return;
        }
        self.key.clear();
        for &k in self.keys {
            self.key.extend_from_slice(fields[k]);
        }
        if delete {
            if !self.deleted.contains(&self.key) {
                self.deleted.insert(self.key.clone());
            }
        } else if self.deleted.contains(&self.key) {
            self.found = true;
        }
    }
}

fn transpose(payload: &[u8], oids: &[u32], keys: &[usize]) -> Option<(Vec<Vec<u8>>, bool)> {
    let n = oids.len();
    let mut rewrites =
        Rewrites { keys, deleted: HashSet::new(), key: Vec::new(), last_place: None, found: false };
    let mut fields: Vec<&[u8]> = Vec::with_capacity(n);
    // ndim, has-null flag, element type, then (for a non-empty array) length and lower bound.
    let mut cols: Vec<Vec<u8>> = oids
        .iter()
        .map(|&oid| {
            let mut c = Vec::with_capacity(payload.len() / n.max(1) + 20);
            for word in [1i32, 0, oid as i32, 0, 1] {
                c.extend_from_slice(&word.to_be_bytes());
            }
            c
        })
        .collect();
    let mut nulls = vec![false; n];
    let mut rows: i32 = 0;
    if !payload.is_empty() {
        let body = payload.strip_prefix(HEADER)?;
        let mut i = 0usize;
        let take = |i: &mut usize, k: usize| -> Option<&[u8]> {
            let s = body.get(*i..*i + k)?;
            *i += k;
            Some(s)
        };
        loop {
            let count = i16::from_be_bytes(take(&mut i, 2)?.try_into().ok()?);
            if count == -1 {
                break;
            }
            if count as usize != n {
                return None;
            }
            fields.clear();
            for j in 0..n {
                let start = i;
                let len_bytes = take(&mut i, 4)?;
                let len = i32::from_be_bytes(len_bytes.try_into().ok()?);
                if len == -1 {
                    nulls[j] = true;
                } else {
                    take(&mut i, usize::try_from(len).ok()?)?;
                }
                cols[j].extend_from_slice(&body[start..i]);
                fields.push(&body[start..i]);
            }
            rewrites.row(&fields);
            rows = rows.checked_add(1)?;
        }
        if i != body.len() {
            return None;
        }
    }
    for (j, c) in cols.iter_mut().enumerate() {
        if rows == 0 {
            // An empty array has no dimension.
            c.truncate(12);
            c[0..4].copy_from_slice(&0i32.to_be_bytes());
        } else {
            c[12..16].copy_from_slice(&rows.to_be_bytes());
        }
        c[4..8].copy_from_slice(&(nulls[j] as i32).to_be_bytes());
    }
    Some((cols, rewrites.found))
}

// ------------------------------------------------------------------------- JSON lines

/// The values joined by line breaks -- one object per line for Arrow's JSON reader -- or None
/// when a value would not be one line holding one object (empty, not starting with `{`, or
/// holding a line break) or, with `utf8`, is not valid UTF-8. The checks and the copy are one
/// pass over the bytes: the Python version counted the buffer twice and decoded it.
#[pyfunction]
#[pyo3(signature = (values, utf8 = false))]
fn join_lines<'py>(py: Python<'py>, values: Vec<Bound<'py, PyBytes>>, utf8: bool) -> PyResult<Option<Bound<'py, PyBytes>>> {
    if values.is_empty() {
        return Ok(None);
    }
    let slices: Vec<&[u8]> = values.iter().map(|v| v.as_bytes()).collect();
    let ok = slices.iter().all(|v| {
        v.first() == Some(&b'{') && !v.contains(&b'\n') && (!utf8 || std::str::from_utf8(v).is_ok())
    });
    if !ok {
        return Ok(None);
    }
    let total = slices.iter().map(|v| v.len()).sum::<usize>() + slices.len() - 1;
    let joined = PyBytes::new_with(py, total, |buf: &mut [u8]| {
        let mut at = 0usize;
        for (i, v) in slices.iter().enumerate() {
            if i > 0 {
                buf[at] = b'\n';
                at += 1;
            }
            buf[at..at + v.len()].copy_from_slice(v);
            at += v.len();
        }
        Ok(())
    })?;
    Ok(Some(joined))
}

// ----------------------------------------------------------------- flat objects -> Arrow

/// Integers of at most this magnitude are exactly doubles: an integer column that meets a
/// float becomes a double column only when every integer in it is this small (pyarrow's rule).
const EXACT_DOUBLE_INT: i64 = 1 << 53;

/// A column's values in the storage of its kind (Null until a value sets the kind).
enum FlatData {
    Null,
    Int(Vec<i64>),
    Float(Vec<f64>),
    Str { offsets: Vec<i32>, data: Vec<u8> },
    Bool(Vec<bool>),
}

/// One top-level field's column as it is read: every row so far (`valid` says which hold a
/// value), in the storage of its kind.
struct FlatColumn {
    name: Vec<u8>,
    valid: Vec<bool>,
    data: FlatData,
}

impl FlatColumn {
    fn new(name: Vec<u8>) -> Self {
        FlatColumn { name, valid: Vec::new(), data: FlatData::Null }
    }

    /// Rows up to `rows` that did not set this field: nulls.
    fn pad(&mut self, rows: usize) {
        while self.valid.len() < rows {
            self.push_null();
        }
    }

    fn push_null(&mut self) {
        self.valid.push(false);
        match &mut self.data {
            FlatData::Null => {}
            FlatData::Int(v) => v.push(0),
            FlatData::Float(v) => v.push(0.0),
            FlatData::Bool(v) => v.push(false),
            FlatData::Str { offsets, .. } => offsets.push(*offsets.last().unwrap_or(&0)),
        }
    }

    /// A value for the current row (the column padded to it); None when the column's values
    /// would not be one Arrow type by pyarrow's inference (or a double would not be exact).
    fn push(&mut self, tok: Tok, scratch: &mut Vec<u8>) -> Option<()> {
        let n = self.valid.len();
        match (&self.data, tok) {
            (_, Tok::Null) => {
                self.push_null();
                return Some(());
            }
            (_, Tok::Absent | Tok::Composite) => return None,
            // The first value sets the kind: the rows so far are nulls in its storage.
            (FlatData::Null, Tok::Int(_)) => self.data = FlatData::Int(vec![0; n]),
            (FlatData::Null, Tok::Float(_)) => self.data = FlatData::Float(vec![0.0; n]),
            (FlatData::Null, Tok::True | Tok::False) => self.data = FlatData::Bool(vec![false; n]),
            (FlatData::Null, Tok::Str(..)) => {
                self.data = FlatData::Str { offsets: vec![0; n + 1], data: Vec::new() }
            }
            (FlatData::Int(ints), Tok::Float(_)) => {
                // pyarrow: integers and floats in one column make a double column, refused
                // when an integer is not exactly a double.
                let mut floats = Vec::with_capacity(n + 1);
                for (&v, &ok) in ints.iter().zip(&self.valid) {
                    if ok && v.unsigned_abs() > EXACT_DOUBLE_INT as u64 {
                        return None;
                    }
                    floats.push(v as f64);
                }
                self.data = FlatData::Float(floats);
            }
            _ => {}
        }
        self.valid.push(true);
        match (&mut self.data, tok) {
            (FlatData::Int(v), Tok::Int(x)) => v.push(x),
            (FlatData::Float(v), Tok::Float(x)) => v.push(x),
            (FlatData::Float(v), Tok::Int(x)) => {
                if x.unsigned_abs() > EXACT_DOUBLE_INT as u64 {
                    return None;
                }
                v.push(x as f64)
            }
            (FlatData::Bool(v), Tok::True) => v.push(true),
            (FlatData::Bool(v), Tok::False) => v.push(false),
            (FlatData::Str { offsets, data }, Tok::Str(raw, escaped)) => {
                if escaped {
                    unescape(raw, scratch)?;
                    data.extend_from_slice(scratch);
                } else {
                    data.extend_from_slice(raw);
                }
                offsets.push(i32::try_from(data.len()).ok()?);
            }
            _ => return None, // kinds that pyarrow would not put in one column
        }
        Some(())
    }
}

/// The bits of `flags`, least significant first (Arrow's validity and boolean layout).
fn bitmap(flags: &[bool]) -> Vec<u8> {
    let mut out = vec![0u8; flags.len().div_ceil(8)];
    for (i, &f) in flags.iter().enumerate() {
        if f {
            out[i / 8] |= 1 << (i % 8);
        }
    }
    out
}

/// The flat objects of `docs` as columns, in the order their fields first appear; the rows
/// that are an empty object. None when a value is not one object of scalars (after optional
/// whitespace) in valid UTF-8, repeats a key, or a field's values are not one Arrow type.
fn flat_all(docs: &[&[u8]]) -> Option<(Vec<FlatColumn>, Vec<usize>)> {
    let mut columns: Vec<FlatColumn> = Vec::new();
    let mut by_name: HashMap<Vec<u8>, usize> = HashMap::new();
    // The column of each field position in the previous row: rows of one shape skip the map.
    let mut hint: Vec<usize> = Vec::new();
    let mut empty = Vec::new();
    let mut scratch = Vec::new();
    for (row, doc) in docs.iter().enumerate() {
        let mut p = Parser::object(doc)?;
        let mut position = 0usize;
        members(&mut p, |name, p| {
            let tok = p.value(0)?;
            let at = match hint.get(position) {
                Some(&c) if columns[c].name == name => c,
                _ => match by_name.get(name) {
                    Some(&c) => c,
                    None => {
                        columns.push(FlatColumn::new(name.to_vec()));
                        by_name.insert(name.to_vec(), columns.len() - 1);
                        columns.len() - 1
                    }
                },
            };
            if position < hint.len() {
                hint[position] = at;
            } else {
                hint.push(at);
            }
            position += 1;
            let column = &mut columns[at];
            if column.valid.len() > row {
                return None; // a repeated key: orjson keeps the last, in the first's place
            }
            column.pad(row);
            column.push(tok, &mut scratch)
        })?;
        if position == 0 {
            empty.push(row);
        }
        if !p.at_end() {
            return None;
        }
    }
    for column in &mut columns {
        column.pad(docs.len());
    }
    Some((columns, empty))
}

/// One column for Python: (name, kind, null count, validity bitmap or None, data, offsets or
/// None).
type FlatOut<'py> = (String, &'static str, usize, Option<Bound<'py, PyBytes>>, Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>);

/// `values` (bytes, each one JSON object of scalars) as Arrow buffers: per top-level field, in
/// the order fields first appear, (name, kind -- "null", "int64", "double", "string" or
/// "bool" --, null count, validity bitmap or None when no null, data buffer -- values, or the
/// bits of a bool column --, int32 offsets of a string column or None), and the rows that are
/// an empty object. What pyarrow's inference makes of the decoded objects (``pa.array`` of
/// their dicts), or None when this reader cannot vouch for that: a value that is not one
/// object of scalars in valid UTF-8, a repeated key, a field whose values are of two kinds
/// Arrow does not unify (integers and floats make doubles, when every integer is exact),
/// integers of more than 18 digits, and what the JSON grammar refuses.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn flat_columns<'py>(py: Python<'py>, values: &Bound<'py, PyList>) -> PyResult<Option<(Vec<FlatOut<'py>>, Vec<usize>)>> {
    let owned = bytes_of(values)?;
    let docs: Vec<&[u8]> = owned.iter().map(|b| b.as_bytes()).collect();
    let Some((columns, empty)) = py.detach(|| flat_all(&docs)) else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(columns.len());
    for c in columns {
        let Ok(name) = String::from_utf8(c.name) else {
            return Ok(None);
        };
        let nulls = c.valid.iter().filter(|&&v| !v).count();
        let validity = if nulls > 0 { Some(PyBytes::new(py, &bitmap(&c.valid))) } else { None };
        let (kind, data, offsets): (&'static str, Vec<u8>, Option<Vec<u8>>) = match c.data {
            FlatData::Null => ("null", Vec::new(), None),
            FlatData::Int(v) => ("int64", v.iter().flat_map(|x| x.to_le_bytes()).collect(), None),
            FlatData::Float(v) => ("double", v.iter().flat_map(|x| x.to_le_bytes()).collect(), None),
            FlatData::Bool(v) => ("bool", bitmap(&v), None),
            FlatData::Str { offsets, data } => {
                ("string", data, Some(offsets.iter().flat_map(|x| x.to_le_bytes()).collect()))
            }
        };
        // A column of nulls only: Arrow's null type holds no validity bitmap.
        let (validity, nulls) = if kind == "null" { (None, c.valid.len()) } else { (validity, nulls) };
        out.push((
            name,
            kind,
            nulls,
            validity,
            PyBytes::new(py, &data),
            offsets.map(|o| PyBytes::new(py, &o)),
        ));
    }
    Ok(Some((out, empty)))
}

// ------------------------------------------------------------- the runtime's batch scan

/// An int attribute of a message, or 0 when it has none (Python's `m.partition() or 0`).
fn int_or_zero(v: Bound<'_, PyAny>) -> PyResult<i64> {
    if v.is_none() {
        Ok(0)
    } else {
        v.extract()
    }
}

/// One run of consecutive messages of one partition: (topic, partition, highest offset (-1
/// before any), values kept).
type ScanRun<'py> = (Bound<'py, PyAny>, i64, i64, usize);

/// The runtime's scan of a consumed batch whose values every sink reads itself (the Python
/// loop it replaces: `participants/decoding/json.py` `_decode_batch` with `decode=False`): the
/// messages kept and their values (bytes), the set-aside ones by index with their size (-1: a
/// null value, a tombstone; else a value over `max_record_bytes`), the runs of one partition in
/// order, and the kept values' total size. Each message's `topic()` (or ""), `partition()`,
/// `offset()` (or 0) and `value()` are read once, as the loop read them.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn scan_values<'py>(
    py: Python<'py>,
    msgs: &Bound<'py, PyList>,
    max_record_bytes: usize,
) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>, Vec<(usize, isize)>, Vec<ScanRun<'py>>, usize)> {
    let kept = PyList::empty(py);
    let values = PyList::empty(py);
    let mut set_aside = Vec::new();
    let mut runs: Vec<ScanRun<'py>> = Vec::new();
    let no_topic = PyString::intern(py, "").into_any();
    let mut size = 0usize;
    for (i, m) in msgs.iter().enumerate() {
        let topic = m.call_method0(intern!(py, "topic"))?;
        let topic = if topic.is_truthy()? { topic } else { no_topic.clone() };
        let partition = int_or_zero(m.call_method0(intern!(py, "partition"))?)?;
        let offset = int_or_zero(m.call_method0(intern!(py, "offset"))?)?;
        let same = match runs.last() {
            Some((t, p, _, _)) => *p == partition && (t.is(&topic) || t.eq(&topic)?),
            None => false,
        };
        if !same {
            runs.push((topic, partition, -1, 0));
        }
        let Some(run) = runs.last_mut() else { unreachable!("a run was just pushed") };
        if offset > run.2 {
            run.2 = offset;
        }
        let value = m.call_method0(intern!(py, "value"))?;
        if value.is_none() {
            set_aside.push((i, -1));
            continue;
        }
        let n = value.cast::<PyBytes>()?.as_bytes().len();
        if n > max_record_bytes {
            set_aside.push((i, n as isize));
            continue;
        }
        kept.append(&m)?;
        values.append(&value)?;
        run.3 += 1;
        size += n;
    }
    Ok((kept, values, set_aside, runs, size))
}

#[pymodule]
fn twophase_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CopyEncoder>()?;
    m.add_class::<AvroCopyEncoder>()?;
    m.add_function(wrap_pyfunction!(copy_columns, m)?)?;
    m.add_function(wrap_pyfunction!(event_columns, m)?)?;
    m.add_function(wrap_pyfunction!(join_lines, m)?)?;
    m.add_function(wrap_pyfunction!(flat_columns, m)?)?;
    m.add_function(wrap_pyfunction!(scan_values, m)?)?;
    Ok(())
}
