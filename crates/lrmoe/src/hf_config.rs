//! Hugging Face Qwen3-MoE `config.json` → the training configuration's
//! model section.
//!
//! The fields the model uses map one to one: `hidden_size` → `d_model`,
//! `num_hidden_layers` → `n_layers`, `num_attention_heads` → `n_heads`,
//! `num_key_value_heads` → `n_kv_heads`, `head_dim`,
//! `moe_intermediate_size` → `ffn`, `num_experts` → `n_experts`,
//! `num_experts_per_tok` → `top_k`, `norm_topk_prob` → `renormalize`,
//! `rms_norm_eps` → `rms_eps`, `rope_theta`, `vocab_size` → `vocab`,
//! `max_position_embeddings` → `max_positions`; Qwen3 always normalises
//! query and key heads (`qk_norm`). Where an optional field is missing, the
//! default of `transformers`' `Qwen3MoeConfig` applies.
//!
//! Fields that would change the architecture away from what the model
//! implements (a sliding window, dense layers among the MoE ones, attention
//! bias, tied embeddings, RoPE scaling, shared experts, dropout, another
//! activation or model type) are errors naming the field; metadata and
//! unknown fields are returned as one warning line naming them.

use crate::train::ModelSection;
use serde_json::{Map, Value};

/// Why a `config.json` cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HfConfigError {
    /// Not JSON, or not a JSON object.
    #[error("not a JSON object: {0}")]
    Json(String),
    /// A field the model needs is missing.
    #[error("missing field {0}")]
    Missing(&'static str),
    /// A field has the wrong type or an impossible value.
    #[error("field {field}: {reason}")]
    Value {
        /// The field.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A field asks for an architecture the model does not implement.
    #[error("field {field} = {value}: {why}")]
    Unsupported {
        /// The field.
        field: String,
        /// Its value, as written.
        value: String,
        /// What the model implements instead.
        why: &'static str,
    },
}

/// A read `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct HfModel {
    /// The model section it describes.
    pub model: ModelSection,
    /// Fields read but not used (metadata, training settings, unknown
    /// keys), by name; empty when every field was used.
    pub ignored: Vec<String>,
}

impl HfModel {
    /// One line naming the ignored fields, or `None` when there are none.
    pub fn warning(&self) -> Option<String> {
        (!self.ignored.is_empty()).then(|| {
            format!(
                "config.json fields not used by the model: {}",
                self.ignored.join(", ")
            )
        })
    }
}

/// Fields known to carry no architecture: tokenizer ids, dtype, versions,
/// inference and training settings, and `intermediate_size` (the width of
/// dense MLP layers, of which a Qwen3-MoE model with `decoder_sparse_step`
/// 1 and no `mlp_only_layers` has none).
const METADATA: &[&str] = &[
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "output_router_logits",
    "router_aux_loss_coef",
    "intermediate_size",
    "max_window_layers",
    "sliding_window",
];

/// An architecture switch: field, the test its value must pass, and what
/// the model implements instead.
type Switch = (&'static str, fn(&Value) -> bool, &'static str);

/// The document's fields, and which of them the model reads.
struct Fields<'a> {
    o: &'a Map<String, Value>,
    used: Vec<&'static str>,
}

impl<'a> Fields<'a> {
    /// Field `k`, when present and not null.
    fn get(&mut self, k: &'static str) -> Option<&'a Value> {
        self.used.push(k);
        self.o.get(k).filter(|v| !v.is_null())
    }

    /// A positive integer field, if present.
    fn count(&mut self, k: &'static str) -> Result<Option<usize>, HfConfigError> {
        self.get(k)
            .map(|v| {
                v.as_u64()
                    .filter(|&n| n > 0)
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| bad(k, "must be a positive integer"))
            })
            .transpose()
    }

    /// A positive integer field that must be present.
    fn need(&mut self, k: &'static str) -> Result<usize, HfConfigError> {
        self.count(k)?.ok_or(HfConfigError::Missing(k))
    }

    /// A positive finite number field, if present.
    fn number(&mut self, k: &'static str) -> Result<Option<f64>, HfConfigError> {
        self.get(k)
            .map(|v| {
                v.as_f64()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| bad(k, "must be a positive number"))
            })
            .transpose()
    }
}

/// `model_type` and `architectures`, when given, name Qwen3-MoE.
fn check_kind(f: &mut Fields<'_>) -> Result<(), HfConfigError> {
    if let Some(t) = f.get("model_type") {
        if t.as_str() != Some("qwen3_moe") {
            return Err(unsupported(
                "model_type",
                t,
                "only qwen3_moe configurations are read",
            ));
        }
    }
    if let Some(a) = f.get("architectures") {
        let ok = a
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x.as_str() == Some("Qwen3MoeForCausalLM")));
        if !ok {
            return Err(unsupported(
                "architectures",
                a,
                "only Qwen3MoeForCausalLM is implemented",
            ));
        }
    }
    Ok(())
}

/// Architecture switches: each must have the value the model implements.
fn check_switches(f: &mut Fields<'_>) -> Result<(), HfConfigError> {
    let checks: [Switch; 9] = [
        (
            "hidden_act",
            |v| v.as_str() == Some("silu"),
            "the experts are SwiGLU (silu)",
        ),
        (
            "attention_bias",
            |v| v == &Value::Bool(false),
            "the projections have no bias",
        ),
        (
            "use_sliding_window",
            |v| v == &Value::Bool(false),
            "attention is full causal, no sliding window",
        ),
        (
            "mlp_only_layers",
            |v| v.as_array().is_some_and(|a| a.is_empty()),
            "every layer is an MoE layer",
        ),
        (
            "decoder_sparse_step",
            |v| v.as_u64() == Some(1),
            "every layer is an MoE layer (step 1)",
        ),
        (
            "tie_word_embeddings",
            |v| v == &Value::Bool(false),
            "the LM head is its own matrix",
        ),
        ("rope_scaling", |v| v.is_null(), "plain RoPE, no scaling"),
        (
            "shared_expert_intermediate_size",
            |v| v.as_u64() == Some(0),
            "the MoE layers have no shared expert",
        ),
        (
            "attention_dropout",
            |v| v.as_f64() == Some(0.0),
            "training runs without dropout",
        ),
    ];
    for (field, ok, why) in checks {
        f.used.push(field);
        if let Some(v) = f.o.get(field) {
            if !(ok(v) || (v.is_null() && field != "decoder_sparse_step")) {
                return Err(unsupported(field, v, why));
            }
        }
    }
    Ok(())
}

/// The model section from the shape fields, `transformers`' defaults for
/// the optional ones.
fn shape(f: &mut Fields<'_>) -> Result<ModelSection, HfConfigError> {
    let d_model = f.need("hidden_size")?;
    let n_layers = f.need("num_hidden_layers")?;
    let n_heads = f.need("num_attention_heads")?;
    let n_kv_heads = f.count("num_key_value_heads")?;
    let head_dim = f.count("head_dim")?;
    let ffn = f.need("moe_intermediate_size")?;
    let n_experts = f.need("num_experts")?;
    let top_k = f.need("num_experts_per_tok")?;
    let vocab = f.need("vocab_size")?;
    let max_positions = f.count("max_position_embeddings")?;
    let renormalize = match f.get("norm_topk_prob") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("norm_topk_prob", "must be true or false")),
    };
    let rms_eps = f.number("rms_norm_eps")?.unwrap_or(1e-6);
    let rope_theta = f.number("rope_theta")?.unwrap_or(10_000.0);
    Ok(ModelSection {
        d_model,
        n_layers,
        n_heads,
        ffn,
        n_experts,
        top_k,
        renormalize,
        n_kv_heads: Some(n_kv_heads.unwrap_or(n_heads)),
        head_dim: Some(head_dim.unwrap_or(d_model / n_heads)),
        rope_theta: Some(rope_theta),
        qk_norm: true,
        rms_eps: Some(rms_eps),
        vocab: Some(vocab),
        max_positions: Some(max_positions.unwrap_or(32_768)),
    })
}

/// Reads a Qwen3-MoE `config.json`.
pub fn parse(text: &str) -> Result<HfModel, HfConfigError> {
    let v: Value = serde_json::from_str(text).map_err(|e| HfConfigError::Json(e.to_string()))?;
    let Value::Object(o) = v else {
        return Err(HfConfigError::Json("the document is not an object".into()));
    };
    let mut f = Fields {
        o: &o,
        used: Vec::new(),
    };
    check_kind(&mut f)?;
    check_switches(&mut f)?;
    let model = shape(&mut f)?;
    let ignored = ignored_fields(&o, &f.used);
    Ok(HfModel { model, ignored })
}

/// The keys of `o` not in `used`: known metadata first, then unknown keys
/// marked as such, each group sorted.
fn ignored_fields(o: &Map<String, Value>, used: &[&str]) -> Vec<String> {
    let mut meta: Vec<String> = Vec::new();
    let mut unknown: Vec<String> = Vec::new();
    for k in o.keys().filter(|k| !used.contains(&k.as_str())) {
        if METADATA.contains(&k.as_str()) {
            meta.push(k.clone());
        } else {
            unknown.push(format!("{k} (unknown)"));
        }
    }
    meta.sort();
    unknown.sort();
    meta.extend(unknown);
    meta
}

fn bad(field: &str, reason: &str) -> HfConfigError {
    HfConfigError::Value {
        field: field.into(),
        reason: reason.into(),
    }
}

fn unsupported(field: &str, v: &Value, why: &'static str) -> HfConfigError {
    HfConfigError::Unsupported {
        field: field.into(),
        value: v.to_string(),
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3_30B_A3B: &str = include_str!("../../../examples/qwen3-30b-a3b.config.json");
    const MINI: &str = include_str!("../../../examples/qwen3-moe-mini.config.json");

    #[test]
    fn the_published_shape_reads_as_typed() {
        let m = parse(QWEN3_30B_A3B).unwrap();
        let s = m.model;
        assert_eq!(
            (s.d_model, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim),
            (2048, 48, 32, Some(4), Some(128))
        );
        assert_eq!((s.ffn, s.n_experts, s.top_k), (768, 128, 8));
        assert!(s.renormalize && s.qk_norm);
        assert_eq!(s.rope_theta, Some(1_000_000.0));
        assert_eq!((s.vocab, s.max_positions), (Some(151_936), Some(40_960)));
        assert_eq!(s.rms_eps, Some(1e-6));
        let w = m.warning().unwrap();
        assert!(
            w.contains("torch_dtype") && w.contains("intermediate_size"),
            "{w}"
        );
        assert!(!w.contains("unknown"), "{w}");
    }

    #[test]
    fn the_mini_shape_is_a_valid_model() {
        let m = parse(MINI).unwrap();
        let cfg = crate::train::TrainConfig {
            model: m.model,
            ..Default::default()
        };
        let mc = cfg.model_config(65).unwrap();
        assert!(mc.qk_norm && mc.rope_theta.is_some());
        assert_eq!(mc.n_heads / mc.kv_heads(), 4);
    }

    fn with(field: &str, value: Value) -> String {
        let mut v: Value = serde_json::from_str(MINI).unwrap();
        v[field] = value;
        v.to_string()
    }

    #[test]
    fn architecture_changes_are_errors_naming_the_field() {
        for (field, value) in [
            ("use_sliding_window", Value::Bool(true)),
            ("mlp_only_layers", serde_json::json!([0, 2])),
            ("decoder_sparse_step", serde_json::json!(2)),
            ("attention_bias", Value::Bool(true)),
            ("tie_word_embeddings", Value::Bool(true)),
            (
                "rope_scaling",
                serde_json::json!({"type": "yarn", "factor": 4.0}),
            ),
            ("hidden_act", Value::String("gelu".into())),
            ("model_type", Value::String("qwen2_moe".into())),
            ("shared_expert_intermediate_size", serde_json::json!(5632)),
            ("attention_dropout", serde_json::json!(0.1)),
        ] {
            let e = parse(&with(field, value)).unwrap_err();
            assert!(
                matches!(&e, HfConfigError::Unsupported { field: f, .. } if f == field),
                "{field}: {e}"
            );
        }
    }

    #[test]
    fn bad_values_and_missing_fields_are_errors() {
        for (field, value) in [
            ("hidden_size", serde_json::json!(0)),
            ("num_experts", serde_json::json!(-4)),
            ("num_experts_per_tok", serde_json::json!(2.5)),
            ("rope_theta", serde_json::json!("big")),
            ("rms_norm_eps", serde_json::json!(0)),
            ("norm_topk_prob", serde_json::json!(1)),
        ] {
            let e = parse(&with(field, value)).unwrap_err();
            assert!(
                matches!(&e, HfConfigError::Value { field: f, .. } if f == field),
                "{field}: {e}"
            );
        }
        let mut v: Value = serde_json::from_str(MINI).unwrap();
        v.as_object_mut().unwrap().remove("num_experts");
        assert_eq!(
            parse(&v.to_string()),
            Err(HfConfigError::Missing("num_experts"))
        );
        assert!(matches!(parse("[1, 2]"), Err(HfConfigError::Json(_))));
        assert!(matches!(
            parse("{\"hidden_size\": "),
            Err(HfConfigError::Json(_))
        ));
    }

    #[test]
    fn defaults_follow_transformers_and_unknown_fields_are_named() {
        let text = r#"{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "vocab_size": 300, "my_flag": 3}"#;
        let m = parse(text).unwrap();
        assert_eq!(m.model.n_kv_heads, Some(4));
        assert_eq!(m.model.head_dim, Some(16));
        assert_eq!(m.model.rope_theta, Some(10_000.0));
        assert!(!m.model.renormalize);
        assert_eq!(m.ignored, vec!["my_flag (unknown)".to_string()]);
    }
}
