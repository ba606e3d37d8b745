//! Tensor naming schemes: the official DeepSeek-V4 names and the HF / vLLM names.
//!
//! Everything that spells a tensor name lives here, so the loader never guesses.

use crate::error::{MegaError, Result};

/// One of the three projections of an expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proj {
    /// Gate projection (`w1` / `gate_proj`), `[I, H]`.
    W1,
    /// Down projection (`w2` / `down_proj`), `[H, I]`.
    W2,
    /// Up projection (`w3` / `up_proj`), `[I, H]`.
    W3,
}

impl Proj {
    /// All three, in the order w1, w2, w3.
    pub const ALL: [Proj; 3] = [Proj::W1, Proj::W2, Proj::W3];
}

/// How a checkpoint names its MoE tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Naming {
    /// `layers.L.ffn.gate.{weight,bias,tid2eid}`, `layers.L.ffn.experts.E.w{1,2,3}.*`,
    /// `layers.L.ffn.shared_experts.w{1,2,3}.*`.
    DeepSeekV4,
    /// `model.layers.L.mlp.gate.{weight,e_score_correction_bias,tid2eid}`,
    /// `model.layers.L.mlp.experts.E.{gate,up,down}_proj.*`,
    /// `model.layers.L.mlp.shared_experts.{gate,up,down}_proj.*`.
    Hf,
}

impl Naming {
    /// A short human name.
    pub fn name(self) -> &'static str {
        match self {
            Naming::DeepSeekV4 => "deepseek-v4 (layers.L.ffn.*)",
            Naming::Hf => "hf/vllm (model.layers.L.mlp.*)",
        }
    }

    /// Decides the naming from the tensor names: exactly one scheme must have MoE tensors.
    pub fn detect<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Naming> {
        let (mut v4, mut hf) = (0usize, 0usize);
        for n in names {
            match Naming::DeepSeekV4.parse_moe_layer(n) {
                Some(_) => v4 += 1,
                None if Naming::Hf.parse_moe_layer(n).is_some() => hf += 1,
                None => {}
            }
        }
        match (v4 > 0, hf > 0) {
            (true, false) => Ok(Naming::DeepSeekV4),
            (false, true) => Ok(Naming::Hf),
            (true, true) => Err(MegaError::Config(format!(
                "the checkpoint mixes DeepSeek-V4 names ({v4} tensors under layers.L.ffn.) and HF names \
                 ({hf} tensors under model.layers.L.mlp.)"
            ))),
            (false, false) => Err(MegaError::Config(
                "no MoE tensors found: expected `layers.L.ffn.gate.weight` / `layers.L.ffn.experts.E.w1.*` \
                 (DeepSeek-V4) or `model.layers.L.mlp.gate.weight` / `model.layers.L.mlp.experts.E.gate_proj.*` (HF)"
                    .into(),
            )),
        }
    }

    fn block(self, layer: usize) -> String {
        match self {
            Naming::DeepSeekV4 => format!("layers.{layer}.ffn"),
            Naming::Hf => format!("model.layers.{layer}.mlp"),
        }
    }

    /// The MoE layer a tensor belongs to (router or routed/shared expert tensors only).
    pub fn parse_moe_layer(self, name: &str) -> Option<usize> {
        let (prefix, block) = match self {
            Naming::DeepSeekV4 => ("layers.", ".ffn."),
            Naming::Hf => ("model.layers.", ".mlp."),
        };
        let rest = name.strip_prefix(prefix)?;
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        let layer: usize = rest[..digits].parse().ok()?;
        let tail = rest[digits..].strip_prefix(block)?;
        (tail.starts_with("gate.") || tail.starts_with("experts.") || tail.starts_with("shared_experts."))
            .then_some(layer)
    }

    /// Router weight `[E, H]`.
    pub fn router_weight(self, layer: usize) -> String {
        format!("{}.gate.weight", self.block(layer))
    }

    /// Router bias `[E]` (`gate.bias` / `gate.e_score_correction_bias`).
    pub fn router_bias(self, layer: usize) -> String {
        match self {
            Naming::DeepSeekV4 => format!("{}.gate.bias", self.block(layer)),
            Naming::Hf => format!("{}.gate.e_score_correction_bias", self.block(layer)),
        }
    }

    /// Hash routing table `[vocab, k]`.
    pub fn tid2eid(self, layer: usize) -> String {
        format!("{}.gate.tid2eid", self.block(layer))
    }

    fn proj_name(self, p: Proj) -> &'static str {
        match (self, p) {
            (Naming::DeepSeekV4, Proj::W1) => "w1",
            (Naming::DeepSeekV4, Proj::W2) => "w2",
            (Naming::DeepSeekV4, Proj::W3) => "w3",
            (Naming::Hf, Proj::W1) => "gate_proj",
            (Naming::Hf, Proj::W2) => "down_proj",
            (Naming::Hf, Proj::W3) => "up_proj",
        }
    }

    /// Module (tensor-name prefix without `.weight`) of a routed expert's projection.
    pub fn expert_module(self, layer: usize, expert: usize, p: Proj) -> String {
        format!("{}.experts.{expert}.{}", self.block(layer), self.proj_name(p))
    }

    /// Module of the shared expert's projection.
    pub fn shared_module(self, layer: usize, p: Proj) -> String {
        format!("{}.shared_experts.{}", self.block(layer), self.proj_name(p))
    }

    /// Prefix of all shared-expert tensors of a layer.
    pub fn shared_prefix(self, layer: usize) -> String {
        format!("{}.shared_experts.", self.block(layer))
    }

    /// Prefix of all routed-expert tensors of a layer.
    pub fn experts_prefix(self, layer: usize) -> String {
        format!("{}.experts.", self.block(layer))
    }

    /// Renames a tensor from this scheme to `to` (names outside the MoE block are kept).
    pub fn rename(self, name: &str, to: Naming) -> String {
        if self == to {
            return name.to_string();
        }
        let Some(layer) = self.parse_moe_layer(name) else { return name.to_string() };
        let tail = &name[self.block(layer).len() + 1..];
        let mut out = format!("{}.{}", to.block(layer), tail);
        for (a, b) in [(".w1.", ".gate_proj."), (".w2.", ".down_proj."), (".w3.", ".up_proj.")] {
            let (from, into) = if self == Naming::DeepSeekV4 { (a, b) } else { (b, a) };
            if out.contains(from) {
                out = out.replacen(from, into, 1);
                break;
            }
        }
        let (bias_from, bias_to) = if self == Naming::DeepSeekV4 {
            (".gate.bias", ".gate.e_score_correction_bias")
        } else {
            (".gate.e_score_correction_bias", ".gate.bias")
        };
        if out.ends_with(bias_from) {
            out = format!("{}{}", &out[..out.len() - bias_from.len()], bias_to);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_parse() {
        let v4 = Naming::DeepSeekV4;
        assert_eq!(v4.expert_module(3, 7, Proj::W2), "layers.3.ffn.experts.7.w2");
        assert_eq!(Naming::Hf.expert_module(3, 7, Proj::W3), "model.layers.3.mlp.experts.7.up_proj");
        assert_eq!(v4.parse_moe_layer("layers.12.ffn.gate.weight"), Some(12));
        assert_eq!(v4.parse_moe_layer("layers.12.attn.wq.weight"), None);
        assert_eq!(Naming::Hf.parse_moe_layer("model.layers.4.mlp.experts.0.up_proj.weight"), Some(4));
        assert_eq!(
            v4.rename("layers.1.ffn.gate.bias", Naming::Hf),
            "model.layers.1.mlp.gate.e_score_correction_bias"
        );
        let hf = v4.rename("layers.1.ffn.experts.2.w1.weight_scale_2", Naming::Hf);
        assert_eq!(hf, "model.layers.1.mlp.experts.2.gate_proj.weight_scale_2");
        assert_eq!(Naming::Hf.rename(&hf, v4), "layers.1.ffn.experts.2.w1.weight_scale_2");
        assert!(Naming::detect(["layers.0.ffn.gate.weight", "model.layers.0.mlp.gate.weight"]).is_err());
        assert!(Naming::detect(["embed.weight"]).is_err());
    }
}
