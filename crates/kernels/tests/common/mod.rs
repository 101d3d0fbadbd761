//! Helpers shared by the kernels' device tests: a fresh seed per run and a
//! small xorshift generator of f32 and bf16 inputs.
#![allow(dead_code)] // each test binary uses its own subset
#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use kernels::cpu::f32_to_bf16_bits;

/// xorshift64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// `n` values uniform in [−scale, scale] on a grid of scale·1e-4.
    pub fn f32s(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() % 20001) as f32 / 10000.0 - 1.0) * scale)
            .collect()
    }
    /// The same, rounded to bf16 bits.
    pub fn bf16s(&mut self, n: usize, scale: f32) -> Vec<u16> {
        self.f32s(n, scale)
            .into_iter()
            .map(f32_to_bf16_bits)
            .collect()
    }
    /// `n` bf16 values in [−2, 2].
    pub fn bf16(&mut self, n: usize) -> Vec<u16> {
        self.bf16s(n, 2.0)
    }
}

/// A seed from the clock: fresh inputs every run.
pub fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1
}
