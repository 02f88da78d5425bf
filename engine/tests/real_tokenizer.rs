//! The tokenizer and chat template of the real model reproduce the reference ids exactly.

mod common;

use duet_engine::Model;
use duet_engine::chat::Message;

#[test]
fn reference_token_ids() {
    let model = Model::open(&common::model_path()).expect("model");
    let fx = common::fixture();
    let tok = &model.tokenizer;
    let cases = fx["tokenizer_cases"].as_object().expect("cases");
    assert!(cases.len() >= 20);
    for (text, expected) in cases {
        let expected = common::ids(expected);
        assert_eq!(tok.encode(text), expected, "encoding {text:?}");
        assert_eq!(tok.decode(&expected), *text, "decoding {text:?}");
    }
    for (name, p) in fx["prompts"].as_object().expect("prompts") {
        let prompt = p["prompt"].as_str().expect("prompt");
        assert_eq!(
            tok.encode(prompt),
            common::ids(&p["prompt_ids"]),
            "prompt {name}"
        );
    }
}

#[test]
fn chat_template_renders_the_reference_chat_prompt() {
    let model = Model::open(&common::model_path()).expect("model");
    let fx = common::fixture();
    let chat = model.chat.as_ref().expect("the model has a chat template");
    let rendered = chat
        .render(&[Message::new("user", "What is 2+2?")], true)
        .expect("render");
    assert_eq!(
        rendered,
        fx["prompts"]["chat_2plus2"]["prompt"]
            .as_str()
            .expect("prompt")
    );
}
