//! How a prompt becomes the token ids a worker computes, shared by the worker and the router so
//! that the router finds the blocks a worker cached under the same names
//! ([`crate::kv::block_hashes`]). The worker publishes its [`PromptRecipe`] (its tokenizer as
//! a Hugging Face `tokenizer.json`, its chat template and the ids it puts before every prompt)
//! at [`RECIPE_PATH`]; the router fetches it once per model, so it needs no model volume.

use serde::{Deserialize, Serialize};

/// Where a worker serves its [`PromptRecipe`] on its HTTP port.
pub const RECIPE_PATH: &str = "/npufleet/v1/prompt-recipe";

/// Roles a chat template knows; OpenAI's `developer` is the chat templates' `system`.
pub const CHAT_ROLES: &[&str] = &["system", "developer", "user", "assistant"];

/// Everything needed to turn a request's prompt into the worker's token ids.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PromptRecipe {
    /// The served model name.
    pub model: String,
    /// The tokenizer, as a Hugging Face `tokenizer.json` document.
    pub tokenizer: serde_json::Value,
    pub chat_template: Option<String>,
    pub bos_token: String,
    pub eos_token: String,
    /// Ids put before every prompt (the BOS token, when the model asks for one).
    pub prefix_ids: Vec<u32>,
    /// Tokens per prefix-cache block.
    pub block_size: usize,
}

/// One chat message, for chat-template application.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("the model has no chat template")]
    NoChatTemplate,
    #[error("{0}")]
    Template(String),
    #[error("tokenizing: {0}")]
    Tokenizer(String),
}

/// Renders `messages` with a Jinja chat template, as Hugging Face transformers and llama.cpp do.
pub fn render_chat_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, PromptError> {
    let template_error =
        |what: &str, e: minijinja::Error| PromptError::Template(format!("{what}: {e}"));
    let mut env = minijinja::Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // Hugging Face transformers and llama.cpp render chat templates with these two on; a
    // template with newlines after its block tags would otherwise render different prompts.
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error("configuring the chat template syntax", e))?,
    );
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| template_error("compiling the chat template", e))?;
    let messages: Vec<_> = messages
        .iter()
        .map(|m| minijinja::context! { role => &m.role, content => &m.content })
        .collect();
    env.get_template("chat")
        .and_then(|t| {
            t.render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token,
                eos_token => eos_token,
            })
        })
        .map_err(|e| template_error("rendering the chat template", e))
}

/// A worker's prompt tokenisation, rebuilt from its recipe.
pub struct PromptTokenizer {
    tokenizer: tokenizers::Tokenizer,
    recipe: PromptRecipe,
}

impl PromptTokenizer {
    pub fn from_recipe(recipe: PromptRecipe) -> Result<Self, PromptError> {
        let tokenizer: tokenizers::Tokenizer = serde_json::from_value(recipe.tokenizer.clone())
            .map_err(|e| PromptError::Tokenizer(format!("reading tokenizer.json: {e}")))?;
        Ok(PromptTokenizer { tokenizer, recipe })
    }

    pub fn block_size(&self) -> usize {
        self.recipe.block_size
    }

    /// The ids the worker computes for a completion prompt.
    pub fn text_tokens(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| PromptError::Tokenizer(e.to_string()))?;
        Ok(self
            .recipe
            .prefix_ids
            .iter()
            .chain(encoding.get_ids())
            .copied()
            .collect())
    }

    /// The ids the worker computes for a chat request (its template, with the generation
    /// prompt, then tokenised).
    pub fn chat_tokens(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, PromptError> {
        let template = self
            .recipe
            .chat_template
            .as_deref()
            .ok_or(PromptError::NoChatTemplate)?;
        let text = render_chat_template(
            template,
            messages,
            true,
            &self.recipe.bos_token,
            &self.recipe.eos_token,
        )?;
        self.text_tokens(&text)
    }
}
