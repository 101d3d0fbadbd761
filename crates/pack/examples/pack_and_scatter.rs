//! Pack the kept rows of one source rank per destination and expert, then
//! scatter results back.

use pack::{gather_rows, plan, unpack_rows, SendRoute};

fn main() -> Result<(), pack::PackError> {
    let width = 4;
    let expert = [0u32, 1, 2, 1, 0, 2];
    let kept = [true, true, false, true, false, true];
    let routes = [
        SendRoute {
            expert: 0,
            rank: 0,
            pairs: 1,
        },
        SendRoute {
            expert: 1,
            rank: 1,
            pairs: 2,
        },
        SendRoute {
            expert: 2,
            rank: 1,
            pairs: 1,
        },
    ];
    let p = plan(&expert, &kept, &routes, 2, 3)?;
    let rows: Vec<f32> = (0..expert.len() * width).map(|i| i as f32).collect();
    let mut packed = vec![0.0; p.packed_rows() * width];
    gather_rows(&rows, width, &p.gather, &mut packed)?;
    println!(
        "send counts {:?}, blocks {:?}",
        p.send_counts, p.block_sizes
    );
    let mut back = vec![0.0; rows.len()];
    unpack_rows(&packed, width, &p.inverse, 0.0, &mut back)?;
    println!("scattered back (dropped rows are zeros): {back:?}");
    Ok(())
}
