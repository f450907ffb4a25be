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

fn py_json(v: &Value, indent: Option<usize>, level: usize, out: &mut String) {
    let pad = |n: usize, out: &mut String| {
        if let Some(i) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(i * n));
        }
    };
    match v {
        Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(if indent.is_some() { "," } else { ", " });
                }
                pad(level + 1, out);
                py_json(x, indent, level + 1, out);
            }
            pad(level, out);
            out.push(']');
        }
        Value::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(if indent.is_some() { "," } else { ", " });
                }
                pad(level + 1, out);
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                py_json(x, indent, level + 1, out);
            }
            pad(level, out);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).unwrap_or_default()),
    }
}

/// `json.dumps(v, ensure_ascii=False, indent=indent)`.
pub fn python_json(v: &Value, indent: Option<usize>) -> String {
    let mut s = String::new();
    py_json(v, indent, 0, &mut s);
    s
}

fn tojson(v: JValue, kwargs: Kwargs) -> std::result::Result<JValue, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<JValue> = kwargs.get("separators")?;
    let json = serde_json::to_value(&v).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(JValue::from_safe_string(python_json(&json, indent)))
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
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime(secs, fmt)
}

pub fn strftime(secs: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] =
        ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
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
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
        env.add_template_owned("chat", source.to_string())
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
