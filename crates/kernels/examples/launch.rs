//! One kernel launch with its CPU twin beside it: SwiGLU on bf16 bits.
//! Run on a GPU machine with `--features cuda`; elsewhere the GPU side says
//! why it cannot run.

use kernels::cpu::{from_bf16, swiglu_bf16_reference, to_bf16};
use kernels::gpu::Gpu;

fn main() -> Result<(), kernels::KernelError> {
    let a = to_bf16(&[1.0, -2.0, 0.5, 3.0]);
    let b = to_bf16(&[0.5, 0.5, 2.0, -1.0]);
    let twin = swiglu_bf16_reference(&a, &b)?;
    println!("CPU twin: {:?}", from_bf16::<f32>(&twin));
    match Gpu::open(0) {
        Ok(gpu) => {
            let h = gpu.swiglu_bf16(&a, &b)?;
            println!(
                "GPU:      {:?} (equal: {})",
                from_bf16::<f32>(&h),
                h == twin
            );
        }
        Err(e) => println!("GPU:      not run ({e})"),
    }
    Ok(())
}
