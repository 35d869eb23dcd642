//! Length-bounded sequence decoding.
//!
//! A sequence's length prefix is checked against a fixed maximum *before* its elements are read, so a
//! small frame cannot make the decoder allocate far more than the frame holds (a list of a million
//! empty lists is a few bytes per element on the wire and tens of bytes each in memory). Used through
//! `#[serde(deserialize_with = "...")]` on every `Vec` field whose elements may be empty or small.

use core::fmt;
use core::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, Error, SeqAccess, Visitor};

struct Bounded<T, const MAX: usize>(PhantomData<T>);

impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for Bounded<T, MAX> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a sequence of at most {MAX} elements")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let hint = seq.size_hint();
        if let Some(n) = hint.filter(|&n| n > MAX) {
            return Err(A::Error::invalid_length(n, &self));
        }
        let mut v = Vec::with_capacity(hint.unwrap_or(0).min(MAX));
        while let Some(x) = seq.next_element()? {
            if v.len() == MAX {
                return Err(A::Error::invalid_length(MAX + 1, &self));
            }
            v.push(x);
        }
        Ok(v)
    }
}

/// Deserializes a `Vec<T>` of at most `MAX` elements.
pub(crate) fn vec<'de, D: Deserializer<'de>, T: Deserialize<'de>, const MAX: usize>(d: D) -> Result<Vec<T>, D::Error> {
    d.deserialize_seq(Bounded::<T, MAX>(PhantomData))
}

#[cfg(test)]
mod tests {
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct S {
        #[serde(deserialize_with = "super::vec::<_, _, 3>")]
        v: Vec<Vec<u8>>,
    }

    #[test]
    fn refuses_long_sequences_before_reading_them() {
        let ok = postcard::to_allocvec(&S { v: vec![vec![], vec![1], vec![]] }).expect("encodes");
        assert_eq!(postcard::from_bytes::<S>(&ok).expect("decodes").v.len(), 3);
        let long = postcard::to_allocvec(&S { v: vec![vec![]; 4] }).expect("encodes");
        assert!(postcard::from_bytes::<S>(&long).is_err());
        // A length prefix claiming a million elements with none present is refused by its length.
        let claim = [0x80, 0x89, 0x7a];
        assert!(postcard::from_bytes::<S>(&claim).is_err());
    }
}
