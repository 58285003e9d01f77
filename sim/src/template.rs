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
    /// What a part without text carries (an image's URL or data, audio):
    /// its identity, as vLLM hashes each multimodal item into its blocks.
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// Tokens an image or audio part takes after its identity: vLLM expands
/// one into hundreds of placeholder tokens (LLaVA 576, Gemma 3 256).
const MEDIA_TOKENS: usize = 512;

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

/// Text parts that follow one another are joined by a line break, as
/// vLLM's chat utils join them; other parts (images, audio) become a
/// placeholder named by a digest of the part, then `MEDIA_TOKENS` tokens,
/// so two pictures are two prompts and each weighs what a server prefills.
fn push_content(out: &mut String, content: Option<&Content>) {
    match content {
        None => {}
        Some(Content::Text(t)) => out.push_str(t),
        Some(Content::Parts(parts)) => {
            let mut after_text = false;
            for p in parts {
                match (&p.text, p.kind.as_str()) {
                    (Some(t), "text") => {
                        if after_text {
                            out.push('\n');
                        }
                        out.push_str(t);
                        after_text = true;
                    }
                    (_, kind) => {
                        let id = crate::hash::hash_str(&Value::Object(p.rest.clone()).to_string());
                        out.push_str(&format!("<{kind} {id:016x}>"));
                        out.push_str(&" px".repeat(MEDIA_TOKENS));
                        after_text = false;
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
        assert!(p.ends_with("<|im_start|>assistant\n"));
        assert!(
            p.contains("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<image_url ")
        );
    }

    #[test]
    fn text_parts_join_with_a_line_break() {
        let m = msgs(serde_json::json!([
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
        ]));
        assert_eq!(
            render(&m, None, false),
            "<|im_start|>user\nHi\nthere<|im_end|>\n"
        );
    }

    /// Two pictures are two prompts, each hundreds of tokens long.
    #[test]
    fn an_image_is_named_by_its_content_and_weighs_hundreds_of_tokens() {
        let ask = |url: &str| {
            let m = msgs(serde_json::json!([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Describe it."}
            ]}]));
            crate::tokenizer::encode(&render(&m, None, true))
        };
        let (cat, dog) = (ask("http://x/cat.png"), ask("http://x/dog.png"));
        assert_eq!(cat, ask("http://x/cat.png"));
        assert_ne!(cat, dog);
        assert!(cat.len() > MEDIA_TOKENS, "{}", cat.len());
        let first_difference = cat.iter().zip(&dog).position(|(a, b)| a != b).unwrap();
        assert!(first_difference < 16, "{first_difference}");
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
