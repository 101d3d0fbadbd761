//! One readable line from an error and its chain of causes.
//!
//! Library errors here often carry their cause both in their message and
//! as their `source()` (thiserror's `#[from]`); printing every link of the
//! chain then repeats it (`a: b: b`). [`one_line`] joins the links with
//! `": "` and leaves out any link whose text the line already holds.

/// The messages of an error chain (outermost first) as one line, each
/// repeated message said once, newlines folded to spaces.
pub fn one_line<I, S>(chain: I) -> String
where
    I: IntoIterator<Item = S>,
    S: std::fmt::Display,
{
    let mut out = String::new();
    for link in chain {
        let msg = link.to_string().replace('\n', " ");
        let msg = msg.trim();
        if msg.is_empty() || out.contains(msg) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(msg);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn repeated_causes_are_said_once() {
        assert_eq!(
            one_line([
                "x.json",
                "cost model field flops_per_s must be finite and > 0 (got 0)",
                "cost model field flops_per_s must be finite and > 0 (got 0)"
            ]),
            "x.json: cost model field flops_per_s must be finite and > 0 (got 0)"
        );
        assert_eq!(
            one_line(["checkpoint: a: bad", "a: bad"]),
            "checkpoint: a: bad"
        );
        assert_eq!(one_line(["a", "b\nc"]), "a: b c");
    }
}
