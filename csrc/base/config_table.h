// The one table of every setting mori-torch reads: environment variables and
// the keys of the backend configs, each declared once in config_table.cpp
// with its name, kind, default, range and doc. Code reads settings only
// through the readers below (no getenv elsewhere); mori_torch.config shows
// the table to Python and generates the README's configuration section.
//
// It sits in base/ (below the GPU shim and the core) so that every layer can
// read its settings without an upward include.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mori_torch {
namespace config {

// Scope of environment variables; the other scopes are config class names
// (the Python dataclasses): "IOEngineConfig", "TcpBackendConfig", ...
constexpr const char* kEnv = "env";

enum class Kind : int {
  Int,     // an integer in [min, max]
  Bool,    // 1/0, true/false, yes/no, on/off (any case)
  Choice,  // one of `choices` (any case) or its index; read as the index
  Text,    // any string (paths, names, lists)
};

struct Entry {
  const char* scope;
  const char* name;
  Kind kind;
  int64_t def;  // Int, Bool (0/1), Choice (index); Text: unused
  int64_t min;  // Int only
  int64_t max;
  const char* text_def;  // Text default ("" when unset means "none")
  const char* choices;   // Choice: comma-separated names, index order
  const char* doc;
  // Env only: "Scope.key" of the config key this variable overrides, or "".
  const char* overrides;
};

const std::vector<Entry>& Table();

// The entry of `name` in `scope`; an undeclared name is a programming error
// (std::logic_error), caught by the tests that scan the sources.
const Entry& Lookup(const char* scope, const std::string& name);

// Environment readers: the variable's value checked against its entry, or
// the entry's default when unset or empty. A bad value throws Error
// (ERR_INVALID_ARGS) naming the variable, the value and what is allowed.
bool EnvIsSet(const char* name);
int64_t EnvInt(const char* name);  // Int, or Choice (the index)
bool EnvBool(const char* name);
std::string EnvText(const char* name);

// Config keys (a backend config arrives as a map of key -> integer):
// throws Error naming the first key of `given` not declared in `scope`.
void CheckKnownKeys(const std::map<std::string, int64_t>& given, const char* scope);
// The value of `key` in `given`, or its default, checked against its range.
int64_t Value(const std::map<std::string, int64_t>& given, const char* scope, const char* key);

}  // namespace config
}  // namespace mori_torch
