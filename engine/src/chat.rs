//! Chat prompts rendered with the model's own Jinja template (`tokenizer.chat_template`).

use serde::{Deserialize, Serialize};

use crate::gguf::Gguf;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message with `role` and `content`.
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// Why a chat prompt could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The model file has no chat template.
    #[error("the model has no chat template (tokenizer.chat_template)")]
    NoTemplate,
    /// The template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` are exposed to it as `bos_token` and `eos_token`.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate, ChatError> {
        let mut env = minijinja::Environment::new();
        // HF templates call `raise_exception` to reject bad conversations.
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ChatError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
        })
    }

    /// The template of a GGUF file, with its BOS and EOS token texts.
    pub fn from_gguf(g: &Gguf) -> Result<ChatTemplate, ChatError> {
        let source = g
            .str("tokenizer.chat_template")
            .map_err(|_| ChatError::NoTemplate)?;
        let token = |key: &str| -> String {
            let tokens = g.strings("tokenizer.ggml.tokens").unwrap_or_default();
            g.u64(key)
                .ok()
                .and_then(|i| tokens.get(i as usize).map(|s| s.to_string()))
                .unwrap_or_default()
        };
        ChatTemplate::new(
            source,
            &token("tokenizer.ggml.bos_token_id"),
            &token("tokenizer.ggml.eos_token_id"),
        )
    }

    /// Renders `messages`, ending with the assistant's turn opened if `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => minijinja::value::Serde(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        })
        .map_err(|e| ChatError::Template(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_chatml_template() {
        let src = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = t.render(&[Message::new("user", "hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let bad = ChatTemplate::new("{{ raise_exception('no') }}", "", "").unwrap();
        assert!(bad.render(&[], false).is_err());
    }
}
