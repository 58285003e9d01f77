//! Hardware presets: the engine's cost model and capacity for one replica.
//!
//! Sources and assumptions (per-token costs are for a 7-8B fp16 model with
//! grouped-query attention, e.g. Qwen2.5-7B: 28 layers, 4 KV heads of dim 128,
//! so 2*28*4*128*2 B = 56 KiB of KV per token):
//! - Decode is memory-bound: each step streams all ~15 GB of weights. A10G
//!   has 600 GB/s (=> ~25 ms floor, ~30 ms observed at batch 1); L4 has
//!   300 GB/s (=> ~50 ms floor, ~60 ms observed). Each extra sequence in the
//!   batch adds its KV reads and sampling work: a mild per-sequence term.
//! - Prefill is compute-bound: ~14 GFLOP per token for 7B; at the 30-40%
//!   tensor-core utilisation vLLM reaches on these cards that is ~0.4 ms per
//!   token on A10G and ~0.5 ms on L4 (power-capped at 72 W).
//! - KV capacity: 24 GB cards, `gpu_memory_utilization` 0.9, minus ~15 GB
//!   weights and ~1 GB activations leaves ~5.5-6 GB => ~100k tokens.
//! - Scheduler limits follow vLLM defaults for online serving: 256 sequences,
//!   2048 batched tokens per step (chunked prefill), block size 16.

use std::fmt;

/// Everything that shapes one replica's engine. All times are simulated ms.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    pub block_size: usize,
    pub kv_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    /// Fixed cost of any step (scheduling, kernel launches, sampling).
    pub step_overhead_ms: f64,
    pub prefill_ms_per_token: f64,
    /// Cost of a step's decode for the first running sequence.
    pub decode_ms_per_step: f64,
    /// Extra decode cost for each further running sequence.
    pub decode_ms_per_seq: f64,
    /// Attention in prefill: ms per million (query token, context token)
    /// pairs. 0: a prompt token costs the same at any depth.
    pub attention_ms_per_mpair: f64,
    /// KV read by each decoding sequence: ms per thousand tokens of its
    /// context. 0: a decoding sequence costs the same at any length.
    pub decode_ms_per_kctx: f64,
    /// Compute and memory traffic overlap (roofline): a step costs the
    /// larger of its compute (prefill, attention) and its memory traffic
    /// (the weights, streamed by any step, and the decoders' KV), not their
    /// sum.
    pub roofline: bool,
    /// Cost of loading a LoRA adapter that is not resident.
    pub lora_load_ms: f64,
    pub max_loras: usize,
    /// Real seconds per simulated second.
    pub time_scale: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// NVIDIA A10G (24 GB), 7B model: ~30 ms/token decode, 0.4 ms/token prefill.
    #[value(name = "a10g-7b")]
    A10g7b,
    /// `a10g-7b` with costs that grow with context: attention in prefill,
    /// the KV each decoder reads, and the weights streamed by every step.
    #[value(name = "a10g-7b-ctx")]
    A10g7bCtx,
    /// NVIDIA L4 (24 GB), 7B model: ~60 ms/token decode, 0.5 ms/token prefill.
    #[value(name = "l4-7b")]
    L47b,
    /// Tiny and quick, for tests: same shape, ~30x cheaper, 8k-token cache.
    #[value(name = "fast")]
    Fast,
}

impl Preset {
    pub fn config(self) -> EngineConfig {
        match self {
            Preset::A10g7b => EngineConfig {
                kv_blocks: 6250,
                step_overhead_ms: 2.0,
                prefill_ms_per_token: 0.4,
                decode_ms_per_step: 28.0,
                decode_ms_per_seq: 0.1,
                ..gpu_7b()
            },
            Preset::A10g7bCtx => EngineConfig {
                // ~0.4 MFLOP of attention per (query, context) pair against
                // ~14 GFLOP of dense work per token (0.4 ms): 0.4 / 35,000
                // ms per pair.
                attention_ms_per_mpair: 11.4,
                // 56 KiB of KV per context token at 600 GB/s.
                decode_ms_per_kctx: 0.096,
                roofline: true,
                ..Preset::A10g7b.config()
            },
            Preset::L47b => EngineConfig {
                kv_blocks: 6250,
                step_overhead_ms: 3.0,
                prefill_ms_per_token: 0.5,
                decode_ms_per_step: 57.0,
                decode_ms_per_seq: 0.2,
                ..gpu_7b()
            },
            Preset::Fast => EngineConfig {
                block_size: 16,
                kv_blocks: 512,
                max_num_seqs: 8,
                max_num_batched_tokens: 512,
                max_model_len: 4096,
                step_overhead_ms: 0.5,
                prefill_ms_per_token: 0.01,
                decode_ms_per_step: 1.0,
                decode_ms_per_seq: 0.01,
                attention_ms_per_mpair: 0.0,
                decode_ms_per_kctx: 0.0,
                roofline: false,
                lora_load_ms: 5.0,
                max_loras: 1,
                time_scale: 1.0,
            },
        }
    }
}

/// What the two 7B GPU presets share.
fn gpu_7b() -> EngineConfig {
    EngineConfig {
        block_size: 16,
        kv_blocks: 6250,
        max_num_seqs: 256,
        max_num_batched_tokens: 2048,
        max_model_len: 32768,
        step_overhead_ms: 2.0,
        prefill_ms_per_token: 0.4,
        decode_ms_per_step: 28.0,
        decode_ms_per_seq: 0.1,
        attention_ms_per_mpair: 0.0,
        decode_ms_per_kctx: 0.0,
        roofline: false,
        lora_load_ms: 50.0,
        max_loras: 1,
        time_scale: 1.0,
    }
}

/// What one step computes, for its cost.
#[derive(Debug, Default, Clone, Copy)]
pub struct Work {
    pub prefill: usize,
    pub decode: usize,
    /// Sum over the step's prompt tokens of the context each attends to.
    pub attention_pairs: f64,
    /// Sum of the decoding sequences' contexts.
    pub decode_context: usize,
}

impl EngineConfig {
    /// Simulated duration of a step with `prefill` prompt tokens and
    /// `decode` sequences each producing one token, at no context.
    #[cfg(test)]
    pub fn step_ms(&self, prefill: usize, decode: usize) -> f64 {
        self.step_cost(&Work {
            prefill,
            decode,
            ..Work::default()
        })
    }

    /// Simulated duration of a step that does `w`.
    pub fn step_cost(&self, w: &Work) -> f64 {
        let compute = self.prefill_ms_per_token * w.prefill as f64
            + self.attention_ms_per_mpair * w.attention_pairs / 1e6;
        let kv = self.decode_ms_per_kctx * w.decode_context as f64 / 1e3;
        let decoders = self.decode_ms_per_seq * w.decode.saturating_sub(1) as f64;
        if self.roofline {
            let memory = self.decode_ms_per_step + decoders + kv;
            return self.step_overhead_ms + compute.max(memory);
        }
        let decode_ms = if w.decode == 0 {
            0.0
        } else {
            self.decode_ms_per_step + decoders + kv
        };
        self.step_overhead_ms + compute + decode_ms
    }

    pub fn kv_tokens(&self) -> usize {
        self.kv_blocks * self.block_size
    }

    /// Rejects configurations the engine cannot run (it would stall).
    pub fn validate(&self) -> Result<(), String> {
        let checks = [
            (self.block_size > 0, "block size must be > 0"),
            (self.kv_blocks > 0, "kv blocks must be > 0"),
            (self.max_num_seqs > 0, "max-num-seqs must be > 0"),
            (
                self.max_num_batched_tokens >= self.max_num_seqs,
                "max-num-batched-tokens must be >= max-num-seqs (every running sequence decodes each step)",
            ),
            (self.max_model_len > 0, "max-model-len must be > 0"),
            (self.time_scale > 0.0 && self.time_scale.is_finite(), "time-scale must be > 0"),
            (self.max_loras > 0, "max-loras must be > 0"),
        ];
        let costs = [
            self.step_overhead_ms,
            self.prefill_ms_per_token,
            self.decode_ms_per_step,
            self.decode_ms_per_seq,
            self.lora_load_ms,
        ];
        if costs.iter().any(|c| !c.is_finite() || *c < 0.0) {
            return Err("costs must be finite and >= 0".into());
        }
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, msg)) => Err((*msg).into()),
            None => Ok(()),
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Preset::A10g7b => "a10g-7b",
            Preset::A10g7bCtx => "a10g-7b-ctx",
            Preset::L47b => "l4-7b",
            Preset::Fast => "fast",
        };
        f.write_str(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_match_their_sources() {
        for p in [
            Preset::A10g7b,
            Preset::A10g7bCtx,
            Preset::L47b,
            Preset::Fast,
        ] {
            p.config().validate().unwrap();
        }
        let a = Preset::A10g7b.config();
        assert_eq!(a.step_ms(0, 1), 30.0);
        assert!((95_000..=105_000).contains(&a.kv_tokens()));
        let l = Preset::L47b.config();
        assert_eq!(l.step_ms(0, 1), 60.0);
        // Batch growth is mild: 64 sequences cost well under 2x batch 1.
        assert!(a.step_ms(0, 64) < 1.5 * a.step_ms(0, 1));
        assert!((400.0..=500.0).contains(&(l.step_ms(1000, 0) - l.step_overhead_ms)));
    }

    /// The context-aware preset: a cached prompt still streams the
    /// weights, a token deep in a long context costs more than one near
    /// the start, and a decoder reads its KV.
    #[test]
    fn context_costs_grow_with_depth() {
        let (flat, ctx) = (Preset::A10g7b.config(), Preset::A10g7bCtx.config());
        let chunk = |start: usize, n: usize| Work {
            prefill: n,
            attention_pairs: n as f64 * (start as f64 + n as f64 / 2.0),
            ..Work::default()
        };
        // A fully cached prompt: 16 tokens recomputed.
        assert!(ctx.step_cost(&chunk(15_000, 16)) >= 30.0);
        assert!(flat.step_cost(&chunk(15_000, 16)) < 10.0);
        // 1,000 new tokens behind 15k and 50k cached: ~1.4x and ~2.3x.
        let (shallow, deep) = (
            ctx.step_cost(&chunk(0, 1000)),
            ctx.step_cost(&chunk(15_000, 1000)),
        );
        assert!((1.3..1.6).contains(&(deep / shallow)), "{deep} / {shallow}");
        let deeper = ctx.step_cost(&chunk(50_000, 1000));
        assert!(
            (2.1..2.6).contains(&(deeper / shallow)),
            "{deeper} / {shallow}"
        );
        // A decoder at 15k context reads ~1.4 ms of KV a step.
        let one = |c: usize| Work {
            decode: 1,
            decode_context: c,
            ..Work::default()
        };
        assert!((1.3..1.6).contains(&(ctx.step_cost(&one(15_000)) - ctx.step_cost(&one(0)))));
        // The flat presets keep their costs.
        assert_eq!(flat.step_cost(&chunk(50_000, 1000)), flat.step_ms(1000, 0));
    }

    #[test]
    fn validate_rejects_stalling_configs() {
        let mut c = Preset::Fast.config();
        c.max_num_batched_tokens = c.max_num_seqs - 1;
        assert!(c.validate().is_err());
        let mut c = Preset::Fast.config();
        c.time_scale = 0.0;
        assert!(c.validate().is_err());
    }
}
