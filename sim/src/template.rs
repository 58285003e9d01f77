//! Chat template: renders messages into one prompt string the way
//! ChatML-style servers do (`<|im_start|>role\ncontent<|im_end|>\n`), tools
//! first as a system block, ending with the assistant generation prompt.
//! Rendering is deterministic, so a conversation's earlier turns always
//! render to the same leading tokens (what makes prefix caching work).

use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Option<Value>,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize, Debug)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// The prompt text for `messages` (and `tools`, if any).
pub fn render(messages: &[Message], tools: Option<&Value>, add_generation_prompt: bool) -> String {
    let mut out = String::new();
    if let Some(tools) = tools.filter(|t| !t.is_null()) {
        out.push_str("<|im_start|>system\n# Tools\n");
        out.push_str(&tools.to_string());
        out.push_str("<|im_end|>\n");
    }
    for m in messages {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        push_content(&mut out, m.content.as_ref());
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_null()) {
            out.push_str("<tool_call>");
            out.push_str(&calls.to_string());
            out.push_str("</tool_call>");
        }
        out.push_str("<|im_end|>\n");
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    out
}

/// Text parts are concatenated; other parts (images, audio) become a fixed
/// placeholder so they still occupy tokens.
fn push_content(out: &mut String, content: Option<&Content>) {
    match content {
        None => {}
        Some(Content::Text(t)) => out.push_str(t),
        Some(Content::Parts(parts)) => {
            for p in parts {
                match (&p.text, p.kind.as_str()) {
                    (Some(t), "text") => out.push_str(t),
                    (_, kind) => {
                        out.push('<');
                        out.push_str(kind);
                        out.push('>');
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: Value) -> Vec<Message> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn renders_chatml_with_tools_first() {
        let m = msgs(serde_json::json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]}
        ]));
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let p = render(&m, Some(&tools), true);
        assert!(p.starts_with("<|im_start|>system\n# Tools\n[{"));
        assert!(p.ends_with(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<image_url><|im_end|>\n<|im_start|>assistant\n"
        ));
    }

    #[test]
    fn earlier_turns_are_a_prefix_of_later_ones() {
        let one = msgs(serde_json::json!([{"role": "user", "content": "a"}]));
        let two = msgs(serde_json::json!([
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}
        ]));
        assert!(render(&two, None, true).starts_with(&render(&one, None, false)));
    }
}
