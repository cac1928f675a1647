// Validate AsyncAPI documents with the official parser, @asyncapi/parser.
//
//   node tests/asyncapi/validate.mjs [--json] FILE...
//
// For each file (JSON or YAML), prints the parser's diagnostics: its errors and
// warnings, one per line (information and hints too with --all). With --json, prints
// one JSON object instead: {FILE: {"valid": bool, "diagnostics": [{"severity",
// "code", "message", "path"}]}}, every diagnostic included. Exits 1 when a document
// has an error (the parser gives no document for it), 2 for a bad command line.
// Install the parser first: (cd tests/asyncapi && npm ci --ignore-scripts).

import { readFile } from "node:fs/promises";
import { Parser } from "@asyncapi/parser";

const SEVERITIES = ["error", "warning", "information", "hint"];

const args = process.argv.slice(2);
const asJson = args.includes("--json");
const all = args.includes("--all");
const files = args.filter((arg) => !arg.startsWith("--"));
if (files.length === 0) {
  console.error("usage: node validate.mjs [--json] [--all] FILE...");
  process.exit(2);
}

const parser = new Parser();
const results = {};
let failed = false;
for (const file of files) {
  const text = await readFile(file, "utf8");
  const { document, diagnostics } = await parser.parse(text, { source: file });
  const valid = document !== undefined;
  failed ||= !valid;
  results[file] = {
    valid,
    diagnostics: diagnostics.map((diagnostic) => ({
      severity: SEVERITIES[diagnostic.severity] ?? String(diagnostic.severity),
      code: String(diagnostic.code),
      message: diagnostic.message,
      path: diagnostic.path.join("."),
    })),
  };
}

if (asJson) {
  console.log(JSON.stringify(results));
} else {
  for (const [file, { valid, diagnostics }] of Object.entries(results)) {
    console.log(`${file}: ${valid ? "valid" : "INVALID"}`);
    for (const { severity, code, message, path } of diagnostics) {
      if (all || severity === "error" || severity === "warning") {
        console.log(`  ${severity} ${code} at ${path || "(root)"}: ${message}`);
      }
    }
  }
}
process.exit(failed ? 1 : 0);
