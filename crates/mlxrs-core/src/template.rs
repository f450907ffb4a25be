//! Chat templates rendered the way transformers renders them: Jinja with trim_blocks and
//! lstrip_blocks, loop controls, Python string/dict methods, `raise_exception`, `strftime_now`,
//! and a `tojson` that writes what Python's `json.dumps` writes (no HTML escaping).
use crate::error::{Error, Result};
use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, ErrorKind};
use serde_json::Value;

/// Inputs to a template render.
pub struct ChatInput<'a> {
    pub messages: &'a Value,
    pub tools: Option<&'a Value>,
    pub add_generation_prompt: bool,
    pub bos_token: Option<&'a str>,
    pub eos_token: Option<&'a str>,
    /// Extra variables (enable_thinking, …).
    pub extra: &'a serde_json::Map<String, Value>,
}

pub struct ChatTemplate {
    env: Environment<'static>,
}

/// How `json.dumps` writes: `indent`, `ensure_ascii`, `sort_keys` and `separators` as Python has them.
#[derive(Clone, Debug, Default)]
pub struct JsonStyle {
    pub indent: Option<usize>,
    pub ensure_ascii: bool,
    pub sort_keys: bool,
    /// (item separator, key separator); Python's default is `(", ", ": ")`, `(",", ": ")` with an indent.
    pub separators: Option<(String, String)>,
}

/// A JSON string literal as Python's `json.dumps` writes it (`\uXXXX` for non-ASCII when `ascii`).
fn py_json_str(s: &str, ascii: bool, out: &mut String) {
    let quoted = serde_json::to_string(s).unwrap_or_default();
    if !ascii {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for u in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
}

fn py_json(v: &Value, st: &JsonStyle, level: usize, out: &mut String) {
    let (item_sep, key_sep) = match &st.separators {
        Some((i, k)) => (i.as_str(), k.as_str()),
        None if st.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let pad = |n: usize, out: &mut String| {
        if let Some(i) = st.indent {
            out.push('\n');
            out.push_str(&" ".repeat(i * n));
        }
    };
    match v {
        Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                pad(level + 1, out);
                py_json(x, st, level + 1, out);
            }
            pad(level, out);
            out.push(']');
        }
        Value::Object(o) if !o.is_empty() => {
            out.push('{');
            let mut items: Vec<(&String, &Value)> = o.iter().collect();
            if st.sort_keys {
                items.sort_by(|a, b| a.0.cmp(b.0));
            }
            for (i, (k, x)) in items.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                pad(level + 1, out);
                py_json_str(k, st.ensure_ascii, out);
                out.push_str(key_sep);
                py_json(x, st, level + 1, out);
            }
            pad(level, out);
            out.push('}');
        }
        Value::String(s) => py_json_str(s, st.ensure_ascii, out),
        other => out.push_str(&serde_json::to_string(other).unwrap_or_default()),
    }
}

/// `json.dumps(v, **style)`.
pub fn python_json(v: &Value, style: &JsonStyle) -> String {
    let mut s = String::new();
    py_json(v, style, 0, &mut s);
    s
}

fn tojson(v: JValue, kwargs: Kwargs) -> std::result::Result<JValue, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // transformers' tojson: json.dumps(x, ensure_ascii=False, indent, separators, sort_keys)
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<JValue> = kwargs.get("separators")?;
    let separators = match separators {
        None => None,
        Some(s) if s.is_none() => None,
        Some(s) => {
            let parts: Vec<String> = s
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .filter(|p| p.len() == 2)
                .ok_or_else(|| {
                    minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")
                })?;
            Some((parts[0].clone(), parts[1].clone()))
        }
    };
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
        separators,
    };
    let json =
        serde_json::to_value(&v).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(JValue::from_safe_string(python_json(&json, &style)))
}

/// A float as Python's `repr` writes it: the shortest round-trip digits, exponent form below 1e-4
/// and from 1e16 (`1e-05`, `1e+16`), a `.0` on integral values.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let e = format!("{f:e}"); // e.g. 1e-5, 1.5e16
        let (m, x) = e.split_once('e').unwrap_or((&e, "0"));
        let x: i32 = x.parse().unwrap_or(0);
        return format!("{m}e{}{:02}", if x < 0 { '-' } else { '+' }, x.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

/// A string as Python's `repr` writes it: single quotes unless the string has one and no double one.
fn py_str_repr(s: &str, out: &mut String) {
    let q = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(q);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == q => {
                out.push('\\');
                out.push(c)
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(q);
}

/// `repr(v)` of the Python value a template variable holds (what Jinja prints for a dict or a list).
fn py_repr(v: &JValue, out: &mut String) {
    use minijinja::value::ValueKind;
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::String => py_str_repr(v.as_str().unwrap_or_default(), out),
        ValueKind::Number => match f64::try_from(v.clone()) {
            Ok(f) if v.as_i64().is_none() => out.push_str(&py_float(f)),
            _ => out.push_str(&v.to_string()),
        },
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, x) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&x, out);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, k) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&k, out);
                out.push_str(": ");
                py_repr(&v.get_item(&k).unwrap_or_default(), out);
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
}

/// `str(v)` as Python writes it for the values a template sees: `True`/`False`/`None`, and `repr`
/// for dicts and lists (their items in repr form).
fn py_str(v: &JValue) -> String {
    use minijinja::value::ValueKind;
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map | ValueKind::Iterable => {
            let mut s = String::new();
            py_repr(v, &mut s);
            s
        }
        ValueKind::Number if v.as_i64().is_none() => {
            f64::try_from(v.clone()).map(py_float).unwrap_or_else(|_| v.to_string())
        }
        _ => v.to_string(),
    }
}

/// Jinja's `length`: `len(x)`; an undefined value is empty (Jinja's `Undefined` has length 0).
fn length(v: JValue) -> std::result::Result<usize, minijinja::Error> {
    if v.is_undefined() {
        return Ok(0);
    }
    v.len().ok_or_else(|| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("cannot calculate length of value of type {}", v.kind()),
        )
    })
}

/// Jinja's `iterable` test: `none` is not iterable (an undefined value is, and empty).
fn is_iterable(v: JValue) -> bool {
    v.is_undefined() || (!v.is_none() && v.try_iter().is_ok())
}

/// transformers' `{% generation %}…{% endgeneration %}` (it marks the assistant's tokens for
/// training masks and renders its body unchanged) rewritten as an always-true `if` block, which
/// renders its body and trims whitespace exactly as the tags it replaces do.
fn rewrite_generation_blocks(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let Some(end) = tag.find("%}") else { break };
        let inner = &tag[2..end];
        let (lead, body) = match inner.chars().next() {
            Some(c @ ('-' | '+')) => (Some(c), &inner[1..]),
            _ => (None, inner),
        };
        let (body, trail) = match body.chars().last() {
            Some(c @ ('-' | '+')) => (&body[..body.len() - 1], Some(c)),
            _ => (body, None),
        };
        let word = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match word {
            Some(w) => {
                out.push_str("{%");
                lead.into_iter().for_each(|c| out.push(c));
                out.push(' ');
                out.push_str(w);
                out.push(' ');
                trail.into_iter().for_each(|c| out.push(c));
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn raise_exception(msg: String) -> std::result::Result<JValue, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// Days since 1970-01-01 → (year, month, day) (Howard Hinnant's civil_from_days).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { yoe + era * 400 + 1 } else { yoe + era * 400 }, m, d)
}

/// `strftime_now(fmt)` in UTC for the directives templates use.
pub fn strftime_now(fmt: &str) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime(secs, fmt)
}

pub fn strftime(secs: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil(days);
    let wd = DAYS[days.rem_euclid(7) as usize];
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('-') => match it.next() {
                Some('d') => out.push_str(&d.to_string()),
                Some('m') => out.push_str(&m.to_string()),
                Some(o) => {
                    out.push_str("%-");
                    out.push(o)
                }
                None => out.push_str("%-"),
            },
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(wd),
            Some('a') => out.push_str(&wd[..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o)
            }
            None => out.push('%'),
        }
    }
    out
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_filter("string", |v: JValue| py_str(&v));
        env.add_filter("length", length);
        env.add_filter("count", length);
        env.add_test("iterable", is_iterable);
        // what `{{ x }}` prints for a value that is not a string or a number: Python's str()
        env.set_formatter(|out, state, v| {
            use minijinja::value::ValueKind;
            match v.kind() {
                ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map | ValueKind::Iterable
                    if !v.is_safe() =>
                {
                    out.write_str(&py_str(v)).map_err(minijinja::Error::from)
                }
                _ => minijinja::escape_formatter(out, state, v),
            }
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
        env.add_template_owned("chat", rewrite_generation_blocks(source))
            .map_err(|e| Error::ModelLoad(format!("the chat template does not parse: {e}")))?;
        Ok(ChatTemplate { env })
    }

    pub fn render(&self, input: &ChatInput<'_>) -> Result<String> {
        let mut ctx = serde_json::Map::new();
        for (k, v) in input.extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), input.messages.clone());
        // transformers passes tools=None when there are none: `tools is defined` holds either way
        ctx.insert("tools".into(), input.tools.cloned().unwrap_or(Value::Null));
        ctx.insert("add_generation_prompt".into(), Value::Bool(input.add_generation_prompt));
        ctx.insert("bos_token".into(), input.bos_token.map(Value::from).unwrap_or(Value::from("")));
        ctx.insert("eos_token".into(), input.eos_token.map(Value::from).unwrap_or(Value::from("")));
        let tmpl = self.env.get_template("chat").map_err(|e| Error::ModelLoad(e.to_string()))?;
        tmpl.render(JValue::from_serialize(Value::Object(ctx))).map_err(|e| {
            let mut msg = format!("chat template error: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            Error::Invalid(msg)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, messages: Value) -> String {
        let extra = serde_json::Map::new();
        let input = ChatInput {
            messages: &messages,
            tools: None,
            add_generation_prompt: false,
            bos_token: None,
            eos_token: None,
            extra: &extra,
        };
        ChatTemplate::new(src).unwrap().render(&input).unwrap()
    }

    #[test]
    fn values_print_as_python_prints_them() {
        let m =
            json!([{"role": "user", "content": "it's", "n": 1.5, "k": 1e-5, "b": true, "z": null, "l": [1, "a\nb"]}]);
        // what Jinja2 prints (Python's str of a dict): checked against `python3 -c "print({...})"`
        assert_eq!(
            render("{{ messages[0] }}|{{ messages[0] | string }}|{{ true }}|{{ none }}", m),
            r#"{'role': 'user', 'content': "it's", 'n': 1.5, 'k': 1e-05, 'b': True, 'z': None, 'l': [1, 'a\nb']}|{'role': 'user', 'content': "it's", 'n': 1.5, 'k': 1e-05, 'b': True, 'z': None, 'l': [1, 'a\nb']}|True|None"#
        );
    }

    #[test]
    fn tojson_options() {
        let m = json!([{"b": "°C", "a": [1, 2]}]);
        assert_eq!(render("{{ messages[0] | tojson }}", m.clone()), r#"{"b": "°C", "a": [1, 2]}"#);
        assert_eq!(
            render("{{ messages[0] | tojson(ensure_ascii=True) }}", m.clone()),
            r#"{"b": "\u00b0C", "a": [1, 2]}"#
        );
        assert_eq!(
            render("{{ messages[0] | tojson(sort_keys=True, separators=(',', ':')) }}", m.clone()),
            r#"{"a":[1,2],"b":"°C"}"#
        );
        assert_eq!(
            render("{{ messages[0] | tojson(indent=2) }}", m),
            "{\n  \"b\": \"°C\",\n  \"a\": [\n    1,\n    2\n  ]\n}"
        );
    }

    #[test]
    fn length_iterable_and_generation_blocks() {
        let m = json!([{"role": "assistant"}]);
        assert_eq!(
            render("{{ messages[0].content | length }}|{{ none is iterable }}|{{ messages is iterable }}", m.clone()),
            "0|False|True"
        );
        assert_eq!(
            render(
                "{%- for m in messages -%}\n{%- generation -%}\n[{{ m.role }}]\n{%- endgeneration -%}\n{%- endfor -%}",
                m
            ),
            "[assistant]"
        );
        assert_eq!(
            rewrite_generation_blocks("a{% generation %}b{%- endgeneration +%}c{{ x }}"),
            "a{% if true %}b{%- endif +%}c{{ x }}"
        );
    }
}
