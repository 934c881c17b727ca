//! Prints, for each `destination_session` input in a directory, how the
//! session ended, with numbers blanked: one line per input, for picking
//! inputs that reach different outcomes into `seeds/`. `cargo run
//! --example classify_session_inputs DIR`.

fn main() -> std::io::Result<()> {
    let dir = std::env::args().nth(1).expect("a directory");
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let data = std::fs::read(&path)?;
        let outcome = match tern_engine::fuzzing::destination_session(&data) {
            Ok(()) => "completed".to_string(),
            Err(error) => error
                .chain()
                .chars()
                .map(|c| if c.is_ascii_digit() { '#' } else { c })
                .collect(),
        };
        println!("{}\t{}\t{outcome}", data.len(), path.display());
    }
    Ok(())
}
