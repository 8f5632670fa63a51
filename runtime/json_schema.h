// Structured output: a JSON Schema (what Ollama's `format`, OpenAI's `response_format` and
// pydantic's `model_json_schema()` send) turned into a GBNF grammar whose sentences are JSON texts
// the schema accepts. Keywords the grammar cannot enforce are refused with an error naming them and
// where they are, never silently dropped: a reply is either valid or not generated.
//
// Enforced: type (one or a list), properties, required, additionalProperties, items, minItems,
// maxItems, enum, const, anyOf, oneOf (as anyOf), allOf of one schema, $ref into the document
// ($defs, definitions; recursion allowed), minLength, maxLength, format date / time / date-time /
// uuid (other formats are annotations: any string), integer minimum/maximum/exclusiveMinimum/
// exclusiveMaximum (within ±10^15, either side open), number minimum/maximum when whole, pattern (runtime/regex_gbnf.h; not with
// minLength/maxLength/format). Annotations (title, description,
// default, examples, ...) are ignored.
//
// Objects list their properties in the schema's order, required ones always, optional ones when
// the model chooses; without `properties` any keys. Replies have no whitespace around them and at
// most one space or a newline and indentation between tokens, so generation ends at the last
// closing bracket or quote.
#pragma once
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace baton {

// Throws Error(Usage) "JSON schema at #/properties/age: ..." for what it cannot enforce.
// Properties keep the schema's order only in an ordered_json (nlohmann::json sorts keys).
std::string json_schema_to_gbnf(const nlohmann::ordered_json& schema);

// Any JSON object (`--format json`, Ollama's `format: "json"`).
std::string json_object_gbnf();

}  // namespace baton
