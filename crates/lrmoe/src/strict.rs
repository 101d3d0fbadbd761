//! Strict JSON: what serde's derive lets through and our schemas forbid.
//!
//! serde's derived `Deserialize` accepts a struct written as a positional
//! array (`[4, {"owner": [0]}]` for `{"n_ranks": 4, "placement": …}`), so a
//! file can parse while meaning something else than it seems to say. The
//! readers here parse as usual (errors name the path and line), then
//! compare the input with the parsed value written back: wherever the
//! schema has an object and the input has an array, the input is refused,
//! naming the path.

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

/// A strict-parse failure: where, and what.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}{message}", if path.is_empty() || path == "." { String::new() } else { format!("{path}: ") })]
pub struct StrictError {
    /// JSON path of the offending value (`.` for the document).
    pub path: String,
    /// 1-based line of the error in the text, when known.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

/// Parses `text` as `T`, refusing arrays where `T` has a struct.
pub fn from_json<T: DeserializeOwned + Serialize>(text: &str) -> Result<T, StrictError> {
    let de = &mut serde_json::Deserializer::from_str(text);
    let parsed: T = serde_path_to_error::deserialize(de).map_err(|e| StrictError {
        path: e.path().to_string(),
        line: Some(e.inner().line()),
        message: e.inner().to_string(),
    })?;
    let input: Value = serde_json::from_str(text).map_err(|e| StrictError {
        path: ".".into(),
        line: Some(e.line()),
        message: e.to_string(),
    })?;
    check_value(&input, &parsed)?;
    Ok(parsed)
}

/// Deserialises `input` as `T` with the same strictness as [`from_json`].
pub fn from_value<T: DeserializeOwned + Serialize>(input: &Value) -> Result<T, StrictError> {
    let parsed: T = serde_path_to_error::deserialize(input).map_err(|e| StrictError {
        path: e.path().to_string(),
        line: None,
        message: e.inner().to_string(),
    })?;
    check_value(input, &parsed)?;
    Ok(parsed)
}

/// Refuses `input` (the document as written) where it has an array and
/// `parsed` (what it was read as) an object: for readers of other formats
/// (TOML) that parse first and check afterwards.
pub fn check_value<T: Serialize>(input: &Value, parsed: &T) -> Result<(), StrictError> {
    let written = serde_json::to_value(parsed).map_err(|e| StrictError {
        path: ".".into(),
        line: None,
        message: e.to_string(),
    })?;
    let mut path = String::new();
    match first_array_for_object(input, &written, &mut path) {
        None => Ok(()),
        Some(p) => Err(StrictError {
            path: if p.is_empty() { ".".into() } else { p },
            line: None,
            message: "expected an object with named fields, got an array".into(),
        }),
    }
}

/// The path of the first place where `written` (the schema's shape) has an
/// object and `input` an array.
fn first_array_for_object(input: &Value, written: &Value, path: &mut String) -> Option<String> {
    match (input, written) {
        (Value::Array(_), Value::Object(_)) => Some(path.clone()),
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                if let Some(w) = b.get(k) {
                    let len = path.len();
                    path.push_str(if path.is_empty() { "" } else { "." });
                    path.push_str(k);
                    let found = first_array_for_object(v, w, path);
                    path.truncate(len);
                    if found.is_some() {
                        return found;
                    }
                }
            }
            None
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                let found = first_array_for_object(v, w, path);
                path.truncate(len);
                if found.is_some() {
                    return found;
                }
            }
            None
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        a: u32,
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        n: u32,
        inner: Inner,
        list: Vec<Inner>,
    }

    #[test]
    fn objects_parse_and_positional_arrays_are_refused_by_path() {
        let ok: Outer = from_json(r#"{"n": 1, "inner": {"a": 2}, "list": [{"a": 3}]}"#).unwrap();
        assert_eq!(ok.list, vec![Inner { a: 3 }]);
        for (text, path) in [
            (r#"[1, {"a": 2}, []]"#, "."),
            (r#"{"n": 1, "inner": [2], "list": []}"#, "inner"),
            (
                r#"{"n": 1, "inner": {"a": 2}, "list": [{"a": 3}, [4]]}"#,
                "list[1]",
            ),
        ] {
            let e = from_json::<Outer>(text).unwrap_err();
            assert_eq!(e.path, path, "{text}");
            assert!(e.message.contains("got an array"));
        }
        let e =
            from_json::<Outer>(r#"{"n": 1, "inner": {"a": 2, "b": 1}, "list": []}"#).unwrap_err();
        assert_eq!(e.path, "inner.b");
    }
}
