//! What the CRD's OpenAPI schema says to a reader, beyond what schemars generates: prose as
//! paragraphs and optional enums that list only their values.

use schemars::Schema;
use schemars::transform::{Transform, transform_subschemas};
use serde_json::Value;

/// Applied to the spec and status schemas (every schema below them included).
pub fn tidy(schema: &mut Schema) {
    Tidy.transform(schema);
}

struct Tidy;

impl Transform for Tidy {
    fn transform(&mut self, schema: &mut Schema) {
        if let Some(Value::String(text)) = schema.get_mut("description") {
            *text = join_wrapped_lines(text);
        }
        optional_enum_without_null(schema);
        transform_subschemas(self, schema);
    }
}

/// Joins the lines a doc comment was wrapped at, so that `kubectl explain` wraps each
/// paragraph to the reader's terminal instead of breaking it where the source did. Blank lines
/// between paragraphs stay, and so does the line break before a list item.
pub fn join_wrapped_lines(text: &str) -> String {
    let mut joined = String::with_capacity(text.len());
    let mut paragraph_break = false;
    for line in text.lines().map(str::trim) {
        if line.is_empty() {
            paragraph_break = !joined.is_empty();
            continue;
        }
        if paragraph_break {
            joined.push_str("\n\n");
        } else if starts_list_item(line) && !joined.is_empty() {
            joined.push('\n');
        } else if !joined.is_empty() {
            joined.push(' ');
        }
        paragraph_break = false;
        joined.push_str(line);
    }
    joined
}

/// `- item`, `* item`, `1. item` or `1) item`.
fn starts_list_item(line: &str) -> bool {
    if line.starts_with("- ") || line.starts_with("* ") {
        return true;
    }
    let digits = line.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0 && (line[digits..].starts_with(". ") || line[digits..].starts_with(") "))
}

/// schemars writes an `Option` of an enum as a nullable type whose values include `null`, so
/// the apiserver's answer to a wrong value offers `"null"` as a supported one. Without `null`
/// the field is an ordinary optional one: the apiserver drops an explicit `null` there as it
/// does for any field that is not nullable, which leaves the field unset, as `None` means.
fn optional_enum_without_null(schema: &mut Schema) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    let Some(Value::Array(values)) = object.get_mut("enum") else {
        return;
    };
    if !values.contains(&Value::Null) {
        return;
    }
    values.retain(|v| !v.is_null());
    if let Some(Value::Array(types)) = object.get_mut("type") {
        types.retain(|t| t != "null");
        if let [only] = types.as_slice() {
            let only = only.clone();
            object.insert("type".to_owned(), only);
        }
    }
    object.remove("nullable");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapped_lines_join_into_paragraphs_and_list_items_keep_their_lines() {
        assert_eq!(
            join_wrapped_lines("Inter-server algorithm; unset keeps HCCL's\nadaptive choice."),
            "Inter-server algorithm; unset keeps HCCL's adaptive choice."
        );
        assert_eq!(
            join_wrapped_lines("First paragraph\nwrapped.\n\nSecond\nparagraph.\n"),
            "First paragraph wrapped.\n\nSecond paragraph."
        );
        assert_eq!(
            join_wrapped_lines(
                "Either:\n- one thing that\n  wraps\n- another\n1. first\n2) second"
            ),
            "Either:\n- one thing that wraps\n- another\n1. first\n2) second"
        );
        assert_eq!(
            join_wrapped_lines("2024 was\n10 years ago"),
            "2024 was 10 years ago"
        );
    }

    #[test]
    fn an_optional_enum_lists_only_its_values() {
        let mut schema = Schema::try_from(serde_json::json!({
            "type": "object",
            "properties": {
                "policy": {"type": ["string", "null"], "enum": ["Always", "Never", null]},
                "plain": {"type": ["string", "null"]},
            }
        }))
        .unwrap();
        tidy(&mut schema);
        let properties = &schema.as_value()["properties"];
        assert_eq!(
            properties["policy"],
            serde_json::json!({"type": "string", "enum": ["Always", "Never"]})
        );
        assert_eq!(
            properties["plain"],
            serde_json::json!({"type": ["string", "null"]})
        );
    }

    /// Every schema in the CRD as generated, with the path to it.
    fn schemas(value: &Value, path: String, out: &mut Vec<(String, Value)>) {
        let Some(object) = value.as_object() else {
            return;
        };
        out.push((path.clone(), value.clone()));
        for (key, child) in object {
            match key.as_str() {
                "properties" => {
                    for (name, property) in child.as_object().into_iter().flatten() {
                        schemas(property, format!("{path}.{name}"), out);
                    }
                }
                "items" | "additionalProperties" => schemas(child, format!("{path}[*]"), out),
                "allOf" | "anyOf" | "oneOf" => {
                    for branch in child.as_array().into_iter().flatten() {
                        schemas(branch, path.clone(), out);
                    }
                }
                _ => {}
            }
        }
    }

    fn crd_schemas() -> Vec<(String, Value)> {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(crate::InferenceService::crd()).unwrap();
        let root = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        let mut out = Vec::new();
        schemas(root, String::new(), &mut out);
        assert!(out.len() > 100, "only {} schemas found", out.len());
        out
    }

    #[test]
    fn the_crd_describes_fields_in_paragraphs() {
        let wrapped: Vec<(String, String)> = crd_schemas()
            .into_iter()
            .filter_map(|(path, schema)| {
                let text = schema["description"].as_str()?.to_owned();
                (join_wrapped_lines(&text) != text).then_some((path, text))
            })
            .collect();
        assert!(
            wrapped.is_empty(),
            "hard-wrapped descriptions: {wrapped:#?}"
        );
    }

    #[test]
    fn no_enum_in_the_crd_offers_null() {
        let with_null: Vec<String> = crd_schemas()
            .into_iter()
            .filter(|(_, schema)| {
                schema["enum"]
                    .as_array()
                    .is_some_and(|values| values.contains(&Value::Null))
            })
            .map(|(path, _)| path)
            .collect();
        assert!(with_null.is_empty(), "enums listing null: {with_null:?}");
    }
}
