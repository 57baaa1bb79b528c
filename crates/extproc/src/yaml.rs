//! A small YAML emitter for JSON values (block style), so the bootstrap is built as a
//! structured value and printed in the form people read.

use serde_json::Value;

/// Renders `v` as a YAML document.
pub(crate) fn to_yaml(v: &Value) -> String {
    let mut out = String::new();
    emit(v, 0, &mut out);
    out
}

fn scalar(v: &Value) -> String {
    match v {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => quote(s),
        Value::Array(a) if a.is_empty() => "[]".to_owned(),
        Value::Object(o) if o.is_empty() => "{}".to_owned(),
        _ => unreachable!("not a scalar"),
    }
}

/// Quotes strings that YAML would otherwise read as something else. Envoy's loader
/// (yaml-cpp) tries each scalar as a boolean (`y`, `n` and `on` among them), then as a
/// number (hexadecimal and octal too) before a string, so such strings are quoted.
fn quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._/-".contains(c))
        && !s.starts_with(['-', '.'])
        && s.parse::<f64>().is_err()
        && !radix_number(s)
        && !matches!(
            s.to_ascii_lowercase().as_str(),
            "true" | "false" | "null" | "yes" | "no" | "on" | "off" | "y" | "n" | "~"
        );
    if plain {
        s.to_owned()
    } else {
        serde_json::to_string(s).expect("strings serialize")
    }
}

/// Whether `s` is a hexadecimal (`0x1f`) or octal (`0o17`) integer.
fn radix_number(s: &str) -> bool {
    let lower = s.to_ascii_lowercase();
    let digits = |rest: &str, radix| !rest.is_empty() && rest.chars().all(|c| c.is_digit(radix));
    lower.strip_prefix("0x").is_some_and(|r| digits(r, 16))
        || lower.strip_prefix("0o").is_some_and(|r| digits(r, 8))
}

fn is_scalar(v: &Value) -> bool {
    match v {
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => true,
    }
}

fn emit(v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(o) if !o.is_empty() => {
            for (k, child) in o {
                if is_scalar(child) {
                    out.push_str(&format!("{pad}{}: {}\n", quote(k), scalar(child)));
                } else {
                    out.push_str(&format!("{pad}{}:\n", quote(k)));
                    emit(child, indent + 2, out);
                }
            }
        }
        Value::Array(a) if !a.is_empty() => {
            for item in a {
                if is_scalar(item) {
                    out.push_str(&format!("{pad}- {}\n", scalar(item)));
                } else {
                    let mut nested = String::new();
                    emit(item, indent + 2, &mut nested);
                    // The first line of the item goes after the dash.
                    let nested = nested.trim_start_matches(' ').to_owned();
                    out.push_str(&format!("{pad}- {nested}"));
                }
            }
        }
        other => out.push_str(&format!("{pad}{}\n", scalar(other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn emits_block_yaml() {
        let v = json!({
            "a": 1,
            "b": "0.25s",
            "c": ["*", {"x": true, "y": {"z": "type.googleapis.com/x.y"}}],
            "@type": "t",
            "e": {},
        });
        let y = to_yaml(&v);
        assert_eq!(
            y,
            "a: 1\nb: 0.25s\nc:\n  - \"*\"\n  - x: true\n    \"y\":\n      z: type.googleapis.com/x.y\n\"@type\": t\ne: {}\n"
        );
    }

    /// Strings Envoy's loader would read as booleans or numbers are quoted; others
    /// stay plain.
    #[test]
    fn strings_that_read_as_other_types_are_quoted() {
        for s in [
            "y", "N", "yes", "Off", "true", "null", "0x1f", "0X1F", "0o17", "017", "1e3", "inf", "",
        ] {
            assert_eq!(quote(s), format!("{s:?}"), "{s}");
        }
        for s in [
            "envoy.filters.http.router",
            "tls/cert.pem",
            "x0x1f",
            "ingress-http",
            "10.0.0.1",
            "0.25s",
            "0xg",
        ] {
            assert_eq!(quote(s), s.to_owned(), "{s}");
        }
    }
}
