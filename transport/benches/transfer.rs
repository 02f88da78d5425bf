//! KV transfer throughput per backend beside memcpy and a raw TCP stream, in one run.
//! `cargo bench -p duet-transport --bench transfer` (also `duet bench --experiment transfer`).

fn main() {
    println!("{}", duet_transport::bench::measure());
}
