//! The client's first token from P's answer (issue #18): P's leg already computed it (`max_tokens: 1`),
//! so a streamed greedy completion gets it as soon as P answers, and D's stream follows without it.
//!
//! Without this the client waits, after P's forward pass, for the KV transfer, D's engine to hear of it
//! at its next step, vLLM's 1 ms idle sleep before the step that schedules the request, and D's forward
//! pass over the last prompt token, which vLLM computes again to sample the token P already sampled
//! (docs/benchmarks.md, "Time to first token"). All of that now lies between the first and the second
//! token instead.
//!
//! Read [`eligible`] first: only where P's token is the token one engine would send and D can continue
//! from it — greedy (`temperature` 0), one choice, one prompt, no echo, no `min_tokens` (P's leg drops
//! it, so P could stop where D may not), no prompt logprobs, nothing that treats output tokens apart
//! from prompt tokens (`CONTINUATION_BREAKS`) — and only on `/v1/completions`. P's answer is used only
//! when it stopped for length (its one token is not a stop), its text is whole (no U+FFFD of a token
//! that ends mid-character), no stop string could begin inside it, and it carries the prompt's token ids
//! and its token's id (P's leg asks for `return_token_ids`): [`from_prefill`].
//!
//! D never recomputes P's token where the client has it: its leg is the [`Continuation`] — P's prompt
//! ids and P's token as the prompt, one token fewer to make — whose stream [`Fixup`] rewrites (usage,
//! text offsets, id). In pull that is D's only leg (it loads the KV of P's whole prompt). In push D's
//! leg leaves with the client's request before P answers; its first token event is checked against P's
//! ([`Sent`]) and sent without that token, and if it differs (greedy P and D can break a near-tie
//! differently) the relay replaces D's leg by the continuation: the client never sees D's other token,
//! nor an error for it. When D's first bytes come before P's answer, D's stream goes through untouched
//! and P's answer is not used.
//!
//! This module parses and rewrites; the relay (`body.rs`) decides when to call it. It must never panic
//! on what a server sends.

use bytes::Bytes;
use serde_json::{Map, Value};

use super::metrics::Endpoint;

/// Whether a client's request may get its first token from P's answer (module docs).
pub(crate) fn eligible(request: &Map<String, Value>, path: &str) -> bool {
    let is = |k: &str, want: &dyn Fn(&Value) -> bool| request.get(k).is_none_or(|v| v.is_null() || want(v));
    let one = |v: &Value| v.as_u64() == Some(1);
    let more_than_one = |v: &Value| v.as_u64().is_some_and(|n| n > 1);
    let single_prompt = match request.get("prompt") {
        Some(Value::String(_)) => true,
        Some(Value::Array(a)) => a.iter().all(Value::is_u64),
        _ => false,
    };
    path == Endpoint::Completions.path()
        && request.get("stream") == Some(&Value::Bool(true))
        && request.get("temperature").and_then(Value::as_f64) == Some(0.0)
        && single_prompt
        && is("n", &one)
        && is("best_of", &one)
        && is("echo", &|v| v == &Value::Bool(false))
        && is("min_tokens", &|v| v.as_u64() == Some(0))
        && is("prompt_logprobs", &|_| false)
        && is("max_tokens", &more_than_one)
        && is("max_completion_tokens", &more_than_one)
        && CONTINUATION_BREAKS.iter().all(|k| is(k, &inert))
}

/// Request fields under which D continuing from P's token (P's token a prompt token on D) would not
/// make what one engine makes: prompt truncation (D's prompt is one longer), penalties on output tokens
/// only, bad words and structured output (their state starts at D's first output token), custom
/// logits processors (they see output tokens). Any of them set (not null, not 0, false or empty): P's
/// token is not used.
const CONTINUATION_BREAKS: [&str; 12] = [
    "truncate_prompt_tokens",
    "presence_penalty",
    "frequency_penalty",
    "bad_words",
    "logits_processors",
    "structured_outputs",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
];

/// A value that asks for nothing: `0`, `false`, `""`, `[]` or `{}` (null is checked by the caller).
fn inert(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// Whether the client asked for token ids in the response (vLLM's `return_token_ids`).
pub(crate) fn wants_token_ids(request: &Map<String, Value>) -> bool {
    request.get("return_token_ids") == Some(&Value::Bool(true))
}

/// Whether one of the request's stop strings could begin inside P's text and end in D's: P's text ends
/// with a proper prefix of it. vLLM looks for stop strings in a request's output text only, and P's
/// token is prompt on D's continuation, so such a stop would be missed.
fn stop_could_straddle(request: &Map<String, Value>, text: &str) -> bool {
    let stops: Vec<&str> = match request.get("stop") {
        Some(Value::String(s)) => vec![s.as_str()],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    stops.iter().any(|s| s.char_indices().skip(1).any(|(i, _)| text.ends_with(&s[..i])))
}

/// Why D's first token event does not carry P's token.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Mismatch(pub(crate) String);

/// P's token, sent to the client, that D's first token event must repeat (push: D's leg left with the
/// client's request before P answered).
#[derive(Debug)]
pub(crate) struct Sent {
    text: String,
    /// P's `logprobs.tokens[0]`, where the request asked for logprobs.
    token: Option<Value>,
    /// P's `token_ids[0]`, where the request asked for token ids.
    token_id: Option<Value>,
    /// D's bytes not yet split into whole events.
    pending: Vec<u8>,
}

/// What P's answer gives a stream that begins with P's token.
#[derive(Debug)]
pub(crate) struct Prefilled {
    /// The SSE event with P's one token.
    pub(crate) event: Bytes,
    /// What D's first token event must repeat, where D computes it again (push).
    pub(crate) sent: Sent,
    /// D's request that continues from P's token, and how its stream reaches the client.
    pub(crate) continuation: Continuation,
}

/// D's continuation of P's token: the client's request with P's prompt token ids and P's token as its
/// prompt and one token fewer to make, so that D computes only the position after P's token (pull:
/// with P's KV of the whole prompt; push, after a first-token mismatch: from D's prefix cache or
/// recomputed). Its stream reaches the client through [`Fixup`].
#[derive(Debug)]
pub(crate) struct Continuation {
    /// D's request, without `kv_transfer_params` (the caller adds P's in pull).
    pub(crate) request: Map<String, Value>,
    pub(crate) fixup: Fixup,
}

/// Makes D's continuation stream read as the rest of one engine's stream after P's token: D's usage
/// counts P's token as output, not prompt; `text_offset`s continue after P's token; P's response id;
/// no `prompt_token_ids` (D's name P's token as prompt; P's event carried the prompt's, where asked).
#[derive(Debug)]
pub(crate) struct Fixup {
    id: Option<Value>,
    offset: u64,
    /// D's bytes not yet split into whole events.
    pending: Vec<u8>,
}

/// P's answer as the start of the client's stream (module docs); None when it cannot stand for the
/// client's first token (P stopped, its text is not whole, a stop string could straddle it, or it lacks
/// the token ids a continuation needs): the relay then passes D's stream through untouched.
pub(crate) fn from_prefill(answer: &Value, request: &Map<String, Value>) -> Option<Prefilled> {
    let choice = answer.get("choices")?.as_array()?.first()?.as_object()?;
    if choice.get("finish_reason")?.as_str()? != "length" {
        return None;
    }
    let text = choice.get("text")?.as_str()?;
    if text.is_empty() || text.contains('\u{fffd}') || stop_could_straddle(request, text) {
        return None;
    }
    let prompt_ids = choice.get("prompt_token_ids")?.as_array()?;
    let p_token = single(choice.get("token_ids"))?;
    if prompt_ids.is_empty() || !prompt_ids.iter().chain([&p_token]).all(Value::is_u64) {
        return None;
    }
    let logprobs = choice.get("logprobs").filter(|v| !v.is_null());
    let token = match logprobs {
        Some(lp) => Some(single(lp.get("tokens"))?),
        None => None,
    };
    let ids = wants_token_ids(request);
    let mut c = choice.clone();
    c.insert("finish_reason".into(), Value::Null);
    c.insert("stop_reason".into(), Value::Null);
    c.remove("prompt_logprobs");
    if !ids {
        // Asked of P by the router for the continuation, not by the client.
        c.remove("token_ids");
        c.remove("prompt_token_ids");
    }
    let mut event = Map::new();
    for k in ["id", "object", "created", "model"] {
        if let Some(v) = answer.get(k) {
            event.insert(k.into(), v.clone());
        }
    }
    event.insert("choices".into(), Value::Array(vec![Value::Object(c)]));
    let event = sse(&Value::Object(event));
    let token_id = ids.then(|| p_token.clone());
    let sent = Sent { text: text.to_owned(), token, token_id, pending: Vec::new() };
    // The next token's text_offset, as vLLM counts it: P's offset plus its token string's length.
    let offset = logprobs
        .and_then(|lp| {
            let at = lp.get("text_offset")?.as_array()?.last()?.as_u64()?;
            let tok = lp.get("tokens")?.as_array()?.last()?.as_str()?;
            Some(at + tok.chars().count() as u64)
        })
        .unwrap_or(0);
    let mut d = request.clone();
    let mut prompt = prompt_ids.clone();
    prompt.push(p_token);
    d.insert("prompt".into(), Value::Array(prompt));
    for k in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = d.get(k).and_then(Value::as_u64) {
            d.insert(k.into(), Value::from(n - 1));
        }
    }
    d.remove("kv_transfer_params");
    let fixup = Fixup { id: answer.get("id").cloned(), offset, pending: Vec::new() };
    Some(Prefilled { event, sent, continuation: Continuation { request: d, fixup } })
}

impl Fixup {
    /// A frame of D's continuation stream, rewritten; a trailing part event is held until it is whole.
    pub(crate) fn data(&mut self, data: &[u8]) -> Bytes {
        self.pending.extend_from_slice(data);
        let mut out = Vec::with_capacity(self.pending.len());
        let mut start = 0;
        while let Some(end) = find(&self.pending[start..], b"\n\n").map(|i| start + i + 2) {
            self.rewrite(&self.pending[start..end], &mut out);
            start = end;
        }
        self.pending.drain(..start);
        Bytes::from(out)
    }

    /// What D sent and was held, at the end of its stream (None when nothing was).
    pub(crate) fn finish(&mut self) -> Option<Bytes> {
        (!self.pending.is_empty()).then(|| Bytes::from(std::mem::take(&mut self.pending)))
    }

    fn rewrite(&self, event: &[u8], out: &mut Vec<u8>) {
        let payload = event.strip_prefix(b"data:").map(<[u8]>::trim_ascii);
        let parsed = payload.and_then(|p| serde_json::from_slice::<Value>(p).ok());
        let Some(Value::Object(mut v)) = parsed else {
            // `[DONE]`, a comment, or what the client gets from D as it is.
            out.extend_from_slice(event);
            return;
        };
        if v.contains_key("error") {
            out.extend_from_slice(event);
            return;
        }
        if let (Some(id), Some(slot)) = (&self.id, v.get_mut("id")) {
            *slot = id.clone();
        }
        if let Some(Value::Object(u)) = v.get_mut("usage") {
            let prompt = u.get("prompt_tokens").and_then(Value::as_u64);
            let completion = u.get("completion_tokens").and_then(Value::as_u64);
            if let (Some(p), Some(c)) = (prompt, completion) {
                u.insert("prompt_tokens".into(), Value::from(p.saturating_sub(1)));
                u.insert("completion_tokens".into(), Value::from(c + 1));
            }
        }
        for c in v.get_mut("choices").and_then(Value::as_array_mut).into_iter().flatten() {
            let Some(c) = c.as_object_mut() else { continue };
            c.remove("prompt_token_ids");
            let offsets = c.get_mut("logprobs").and_then(|lp| lp.get_mut("text_offset")).and_then(Value::as_array_mut);
            for o in offsets.into_iter().flatten() {
                if let Some(n) = o.as_u64() {
                    *o = Value::from(n + self.offset);
                }
            }
        }
        out.extend_from_slice(&sse(&Value::Object(v)));
    }
}

/// The only element of a one-element array.
fn single(v: Option<&Value>) -> Option<Value> {
    match v?.as_array()?.as_slice() {
        [x] => Some(x.clone()),
        _ => None,
    }
}

fn sse(v: &Value) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Serializing a `Value` cannot fail.
    out.extend_from_slice(&serde_json::to_vec(v).unwrap_or_default());
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// What [`Sent::decode_data`] made of a frame of D's stream.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// No whole event yet: nothing to send.
    Hold,
    /// D's first token event was found: send these bytes (the rest of what D sent, that token taken
    /// out), then pass D's stream through.
    Done(Bytes),
}

impl Sent {
    /// Takes a frame of D's stream until its first token event, which it returns without P's token.
    pub(crate) fn decode_data(&mut self, data: &[u8]) -> Result<Step, Mismatch> {
        self.pending.extend_from_slice(data);
        // Events before D's first token (none from vLLM's completions) go out with it, in order; until
        // then every whole event is looked at again with each frame (a few, before the first token).
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(end) = find(&self.pending[start..], b"\n\n").map(|i| start + i + 2) {
            let event = &self.pending[start..end];
            start = end;
            match self.strip(event)? {
                Some(rewritten) => {
                    out.extend_from_slice(&rewritten);
                    out.extend_from_slice(&self.pending[start..]);
                    self.pending.clear();
                    return Ok(Step::Done(Bytes::from(out)));
                }
                None => out.extend_from_slice(event),
            }
        }
        Ok(Step::Hold)
    }

    /// What D sent and was held, at the end of its stream (None when nothing was).
    pub(crate) fn finish(&mut self) -> Option<Bytes> {
        (!self.pending.is_empty()).then(|| Bytes::from(std::mem::take(&mut self.pending)))
    }

    /// `Some(bytes)` — D's first token event without P's token (empty when nothing else is left in it);
    /// `None` — not a token event (a comment, a usage-only event), passed on as it is.
    fn strip(&self, event: &[u8]) -> Result<Option<Vec<u8>>, Mismatch> {
        let Some(payload) = event.strip_prefix(b"data:").map(<[u8]>::trim_ascii) else {
            return Ok(None);
        };
        let Ok(mut v) = serde_json::from_slice::<Value>(payload) else {
            return Err(Mismatch(format!("D's first event is not JSON: {}", String::from_utf8_lossy(payload))));
        };
        if v.get("error").is_some() {
            return Ok(Some(event.to_vec()));
        }
        let Some(c) = v.get_mut("choices").and_then(Value::as_array_mut).and_then(|a| a.first_mut()) else {
            return Ok(None);
        };
        let Some(c) = c.as_object_mut() else {
            return Err(Mismatch("D's first choice is not an object".into()));
        };
        let text = c.get("text").and_then(Value::as_str).unwrap_or_default();
        let Some(rest) = text.strip_prefix(self.text.as_str()) else {
            return Err(Mismatch(format!("D's first text {text:?} does not begin with P's {:?}", self.text)));
        };
        let rest = rest.to_owned();
        c.insert("text".into(), Value::String(rest.clone()));
        let mut tokens_left = 0;
        if let Some(want) = &self.token {
            let lp = c.get_mut("logprobs").and_then(Value::as_object_mut);
            let Some(lp) = lp else {
                return Err(Mismatch("D's first event has no logprobs where P's had".into()));
            };
            tokens_left = pop_first(lp, "tokens", want)?;
            for k in ["token_logprobs", "top_logprobs", "text_offset"] {
                if let Some(Value::Array(a)) = lp.get_mut(k) {
                    if !a.is_empty() {
                        a.remove(0);
                    }
                }
            }
        }
        if let Some(want) = &self.token_id {
            tokens_left = tokens_left.max(pop_first(c, "token_ids", want)?);
        }
        // P's event carried the prompt's ids where the request asked for them.
        c.remove("prompt_token_ids");
        let finished = c.get("finish_reason").is_some_and(|f| !f.is_null());
        let usage = v.get("usage").is_some_and(|u| !u.is_null());
        if rest.is_empty() && tokens_left == 0 && !finished && !usage {
            return Ok(Some(Vec::new()));
        }
        Ok(Some(sse(&v).to_vec()))
    }
}

/// Removes `m[key][0]`, which must equal `want`; returns how many are left.
fn pop_first(m: &mut Map<String, Value>, key: &str, want: &Value) -> Result<usize, Mismatch> {
    let Some(Value::Array(a)) = m.get_mut(key) else {
        return Err(Mismatch(format!("D's first event has no {key} where P's had")));
    };
    match a.first() {
        Some(first) if first == want => {
            a.remove(0);
            Ok(a.len())
        }
        got => Err(Mismatch(format!("D's first {key} {got:?}, P's {want}"))),
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::{eligible, from_prefill, Mismatch, Prefilled, Sent, Step};

    fn req(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    fn p_answer() -> Value {
        json!({"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "text": " the", "finish_reason": "length", "stop_reason": null,
                            "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.5],
                                         "top_logprobs": [{"token_id:5": -0.5}], "text_offset": [0]},
                            "prompt_logprobs": null, "prompt_token_ids": [1, 2, 3], "token_ids": [5]}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    }

    fn client() -> serde_json::Map<String, Value> {
        req(json!({"prompt": "a b c", "stream": true, "temperature": 0.0, "max_tokens": 8, "logprobs": 1}))
    }

    fn pre(answer: &Value) -> Option<Prefilled> {
        from_prefill(answer, &client())
    }

    fn p_sent() -> Sent {
        pre(&p_answer()).unwrap().sent
    }

    fn d_event(text: &str, toks: &[u64], finish: Value) -> String {
        let tokens: Vec<String> = toks.iter().map(|t| format!("token_id:{t}")).collect();
        let lps: Vec<f64> = toks.iter().map(|_| -0.5).collect();
        let v = json!({"id": "cmpl-x", "choices": [{"index": 0, "text": text, "finish_reason": finish,
                        "logprobs": {"tokens": tokens, "token_logprobs": lps,
                                     "top_logprobs": toks.iter().map(|_| json!({})).collect::<Vec<_>>(),
                                     "text_offset": toks.iter().map(|_| 0).collect::<Vec<_>>()}}]});
        format!("data: {v}\n\n")
    }

    fn parse(events: &[u8]) -> Vec<Value> {
        String::from_utf8_lossy(events)
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
            .collect()
    }

    #[test]
    fn only_streamed_greedy_single_completions_are_eligible() {
        let base = json!({"prompt": [1, 2], "stream": true, "temperature": 0.0, "max_tokens": 8});
        assert!(eligible(&req(base.clone()), "/v1/completions"));
        assert!(!eligible(&req(base.clone()), "/v1/chat/completions"));
        for (k, v) in [
            ("stream", json!(false)),
            ("temperature", json!(0.7)),
            ("n", json!(2)),
            ("echo", json!(true)),
            ("min_tokens", json!(2)),
            ("prompt_logprobs", json!(1)),
            ("max_tokens", json!(1)),
            ("prompt", json!(["a", "b"])),
            ("truncate_prompt_tokens", json!(2)),
            ("frequency_penalty", json!(0.5)),
            ("presence_penalty", json!(-1)),
            ("bad_words", json!(["x"])),
            ("structured_outputs", json!({"regex": "a+"})),
            ("guided_json", json!({"type": "object"})),
        ] {
            let mut r = req(base.clone());
            r.insert(k.into(), v.clone());
            assert!(!eligible(&r, "/v1/completions"), "{k}: {v}");
        }
        for (k, v) in [("frequency_penalty", json!(0.0)), ("bad_words", json!([])), ("guided_json", Value::Null)] {
            let mut r = req(base.clone());
            r.insert(k.into(), v.clone());
            assert!(eligible(&r, "/v1/completions"), "{k}: {v} asks for nothing");
        }
        let mut r = req(base);
        r.remove("temperature");
        assert!(!eligible(&r, "/v1/completions"), "vLLM's default temperature samples");
    }

    #[test]
    fn p_answer_becomes_one_unfinished_event() {
        let bytes = pre(&p_answer()).unwrap().event;
        let ev = &parse(&bytes)[0];
        assert_eq!(ev["choices"][0]["text"], " the");
        assert_eq!(ev["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(ev["choices"][0]["logprobs"]["tokens"], json!(["token_id:5"]));
        assert!(ev.get("usage").is_none(), "P's usage is not the client's");
        let mut stopped = p_answer();
        stopped["choices"][0]["finish_reason"] = json!("stop");
        assert!(pre(&stopped).is_none(), "a stop token ends the request: D says so itself");
        let mut partial = p_answer();
        partial["choices"][0]["text"] = json!("\u{fffd}");
        assert!(pre(&partial).is_none());
    }

    #[test]
    fn d_first_event_loses_p_token_even_split_or_merged() {
        let merged = d_event(" the cat", &[5, 9], Value::Null);
        let body = format!("{}{}", d_event(" the", &[5], Value::Null), d_event(" dog", &[7], Value::Null));
        for input in [body.clone(), merged.clone()] {
            for split in 0..input.len() {
                let mut sent = p_sent();
                let mut out = Vec::new();
                let mut done = false;
                for part in [&input.as_bytes()[..split], &input.as_bytes()[split..]] {
                    if done {
                        out.extend_from_slice(part);
                        continue;
                    }
                    match sent.decode_data(part).unwrap() {
                        Step::Hold => {}
                        Step::Done(b) => {
                            out.extend_from_slice(&b);
                            done = true;
                        }
                    }
                }
                assert!(done, "split at {split}");
                let evs = parse(&out);
                let text: String = evs.iter().map(|e| e["choices"][0]["text"].as_str().unwrap()).collect();
                let toks: Vec<Value> = evs
                    .iter()
                    .flat_map(|e| e["choices"][0]["logprobs"]["tokens"].as_array().unwrap().clone())
                    .collect();
                if input == merged {
                    assert_eq!((text.as_str(), toks), (" cat", vec![json!("token_id:9")]));
                } else {
                    assert_eq!((text.as_str(), toks), (" dog", vec![json!("token_id:7")]), "split at {split}");
                }
            }
        }
    }

    #[test]
    fn a_different_first_token_is_a_mismatch_and_a_last_one_keeps_its_finish() {
        let mut sent = p_sent();
        let got = sent.decode_data(d_event(" a", &[6], Value::Null).as_bytes());
        assert!(matches!(got, Err(Mismatch(_))), "{got:?}");
        let mut sent = p_sent();
        let got = sent.decode_data(d_event(" the", &[6], Value::Null).as_bytes());
        assert!(matches!(got, Err(Mismatch(m)) if m.contains("tokens")));
        let mut sent = p_sent();
        let Ok(Step::Done(b)) = sent.decode_data(d_event(" the", &[5], json!("length")).as_bytes()) else {
            panic!("D's only event must be found");
        };
        let ev = &parse(&b)[0];
        assert_eq!(
            (ev["choices"][0]["text"].as_str(), &ev["choices"][0]["finish_reason"]),
            (Some(""), &json!("length"))
        );
    }

    #[test]
    fn the_continuation_is_p_s_prompt_and_token_with_one_token_less() {
        let mut c = client();
        c.insert("max_completion_tokens".into(), json!(8));
        c.insert("kv_transfer_params".into(), json!({"evil": 1}));
        let Prefilled { event, continuation, .. } = from_prefill(&p_answer(), &c).unwrap();
        let d = &continuation.request;
        assert_eq!(
            (&d["prompt"], &d["max_tokens"], &d["max_completion_tokens"]),
            (&json!([1, 2, 3, 5]), &json!(7), &json!(7))
        );
        assert!(!d.contains_key("kv_transfer_params") && d["stream"] == json!(true));
        // The ids were asked of P by the router, not by this client: its event does not carry them.
        let ev = &parse(&event)[0]["choices"][0];
        assert!(ev.get("token_ids").is_none() && ev.get("prompt_token_ids").is_none(), "{ev}");
        c.insert("return_token_ids".into(), json!(true));
        let ev = &parse(&from_prefill(&p_answer(), &c).unwrap().event)[0]["choices"][0];
        assert_eq!((&ev["token_ids"], &ev["prompt_token_ids"]), (&json!([5]), &json!([1, 2, 3])));
        // Without the ids (a P that does not return them) there is no continuation: P's token is not used.
        for k in ["prompt_token_ids", "token_ids"] {
            let mut a = p_answer();
            a["choices"][0].as_object_mut().unwrap().remove(k);
            assert!(pre(&a).is_none(), "{k}");
        }
    }

    #[test]
    fn a_stop_string_that_may_begin_in_p_s_token_keeps_p_s_token_out() {
        for (stop, straddles) in
            [(json!("e c"), true), (json!(["zz", "ex"]), true), (json!(" the"), false), (json!("x"), false)]
        {
            let mut c = client();
            c.insert("stop".into(), stop.clone());
            assert_eq!(from_prefill(&p_answer(), &c).is_none(), straddles, "{stop}");
        }
    }

    #[test]
    fn the_continuation_stream_reads_as_one_engine_s_after_p_s_token() {
        let fixup = || pre(&p_answer()).unwrap().continuation.fixup;
        let d = json!({"id": "cmpl-d", "choices": [{"index": 0, "text": " cat", "prompt_token_ids": [1, 2, 3, 5],
                        "logprobs": {"tokens": ["token_id:9"], "text_offset": [0]}}],
                       "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}});
        let body = format!("data: {d}\n\ndata: [DONE]\n\n");
        for split in 0..body.len() {
            let mut f = fixup();
            let mut out = f.data(&body.as_bytes()[..split]).to_vec();
            out.extend_from_slice(&f.data(&body.as_bytes()[split..]));
            assert!(f.finish().is_none(), "split at {split}");
            let out = String::from_utf8(out).unwrap();
            assert!(out.ends_with("data: [DONE]\n\n"), "{out}");
            let ev = &parse(out.trim_end_matches("data: [DONE]\n\n").as_bytes())[0];
            assert_eq!(ev["id"], "cmpl-x", "P's response id");
            assert_eq!(ev["usage"], json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}));
            let c = &ev["choices"][0];
            assert!(c.get("prompt_token_ids").is_none());
            assert_eq!(
                (&c["text"], &c["logprobs"]["text_offset"]),
                (&json!(" cat"), &json!([10])),
                "after P's token_id:5"
            );
        }
    }
}
