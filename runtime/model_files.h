// Where models live: `-m` takes a path or a known name fetched by scripts/fetch-model.sh into the
// cache folder (${BATON_CACHE:-$HOME/.cache/baton}/models).
#pragma once
#include <string>
#include <vector>

namespace baton {

struct KnownModel {
  const char* name;     // what users type: -m smollm2-135m
  const char* file;     // file name in the cache's models/ folder
  const char* what;     // one line for --help and errors
};
const std::vector<KnownModel>& known_models();

std::string cache_dir();
// A path to an existing file, or a known name whose file is in the cache. Anything else is an
// Error(Model) that says how to fetch it.
std::string resolve_model(const std::string& name_or_path);

}  // namespace baton
