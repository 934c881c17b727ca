//! The machine-readable contract: a JSON schema of every document a script
//! reads from tern, generated from the types that produce them and checked
//! in as docs/schema/tern-contract.json. The test fails when the types and
//! the checked-in file differ; `TERN_WRITE_SCHEMA=1 cargo test -p tern
//! schema` rewrites the file (then review the diff and, if a field changed
//! meaning or went away, raise `CONTRACT_VERSION`).

use serde_json::{Value, json};

/// The contract's schema: one definition per document.
pub(crate) fn contract() -> Value {
    let schema = |value: schemars::Schema| value.to_value();
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "tern's script contract",
        "contract-version": tern_engine::CONTRACT_VERSION,
        "documents": {
            "source-report": schema(schemars::schema_for!(tern_engine::MigrationStats)),
            "receive-report": schema(schemars::schema_for!(crate::command::receive::ReceiveJson)),
            "event": schema(schemars::schema_for!(tern_engine::Event)),
            "event-history": schema(schemars::schema_for!(tern_engine::EventHistory)),
            "address-event": schema(schemars::schema_for!(crate::report::AddressEvent)),
            "migration-parameters": schema(schemars::schema_for!(tern_engine::MigrationParameters)),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::contract;

    const CHECKED_IN: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/schema/tern-contract.json"
    );

    #[test]
    fn the_checked_in_schema_matches_the_types() {
        let generated = serde_json::to_string_pretty(&contract()).unwrap() + "\n";
        if std::env::var_os("TERN_WRITE_SCHEMA").is_some() {
            std::fs::write(CHECKED_IN, &generated).unwrap();
        }
        let checked_in = std::fs::read_to_string(CHECKED_IN).unwrap_or_default();
        assert!(
            checked_in == generated,
            "docs/schema/tern-contract.json is not the schema of the types: \
             run `TERN_WRITE_SCHEMA=1 cargo test -p tern schema`, review the diff, \
             and raise CONTRACT_VERSION if a field changed meaning or went away"
        );
    }

    #[test]
    fn every_report_field_is_documented_in_the_schema() {
        // schemars takes descriptions from the doc comments: a field
        // without one is undocumented.
        fn walk(value: &serde_json::Value, path: &str, missing: &mut Vec<String>) {
            if let Some(properties) = value.get("properties").and_then(|p| p.as_object()) {
                for (name, property) in properties {
                    let described = property.get("description").is_some();
                    let referenced = property.get("$ref").is_some()
                        || property.get("allOf").is_some()
                        || property.get("anyOf").is_some();
                    if !described && !referenced {
                        missing.push(format!("{path}.{name}"));
                    }
                }
            }
            if let Some(object) = value.as_object() {
                for (key, child) in object {
                    walk(child, &format!("{path}/{key}"), missing);
                }
            }
        }
        let mut missing = Vec::new();
        walk(&contract(), "", &mut missing);
        assert!(
            missing.is_empty(),
            "fields without a description: {missing:?}"
        );
    }
}
