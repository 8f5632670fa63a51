// `baton tokenize`: the ids (and with --pieces, the text of each token) a model's tokenizer gives a
// prompt. Only the tokenizer metadata is read; no weights are loaded.
#include <cstdio>
#include <memory>

#include <fmt/format.h>

#include "cli/command.h"
#include "cli/options.h"
#include "gguf/error.h"
#include "gguf/gguf.h"
#include "runtime/model_files.h"
#include "runtime/tokenizer.h"
#include "runtime/unicode.h"

namespace baton {
namespace {

struct Opts {
  std::string model, prompt, file;
  bool no_bos = false, pieces = false, special = false;
};

// A token's bytes as a readable, one-line string: escapes for control characters, \xNN for bytes
// that are not (complete) UTF-8.
std::string printable(const std::string& s) {
  std::string out;
  for (size_t pos = 0; pos < s.size();) {
    const auto b = uint8_t(s[pos]);
    const size_t n = unicode::utf8_len(b);
    size_t p2 = pos;
    const uint32_t cp = unicode::decode_one(s, p2);
    const bool valid = p2 - pos == n && (n > 1 || b < 0x80);
    if (!valid) {
      out += fmt::format("\\x{:02X}", b);
      pos += 1;
      continue;
    }
    switch (cp) {
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '\\': out += "\\\\"; break;
      default:
        if (cp < 0x20 || cp == 0x7F)
          out += fmt::format("\\x{:02X}", cp);
        else
          out.append(s, pos, p2 - pos);
    }
    pos = p2;
  }
  return out;
}

int run(const Opts& o) {
  auto file = gguf::File::open(resolve_model(o.model));
  const Tokenizer tok = Tokenizer::from_gguf(*file);
  const std::string text = o.file.empty() ? o.prompt : cli::read_text(o.file);
  const auto ids = tok.encode(text, /*add_special=*/!o.no_bos, /*parse_special=*/o.special);
  if (o.pieces) {
    for (int32_t id : ids) fmt::print("{:>7} '{}'\n", id, printable(tok.decode_piece(id, /*show_special=*/true)));
  } else {
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) line += (i ? " " : "") + std::to_string(ids[i]);
    fmt::print("{}\n", line);
  }
  cli::flush_stdout();
  return 0;
}

cli::Register reg{{"tokenize", "Print the token ids of a text (and the text of each token)", [](CLI::App& app) {
  auto o = std::make_shared<Opts>();
  app.add_option("-m,--model", o->model, "model file or known name (see scripts/fetch-model.sh)")->required();
  auto* p = app.add_option("-p,--prompt", o->prompt, "text to tokenize");
  auto* f = app.add_option("-f,--file", o->file, "read the text from a file ('-' for stdin)");
  p->excludes(f);
  f->excludes(p);
  app.add_flag("--no-bos", o->no_bos, "do not add BOS/EOS even where the model asks for them");
  app.add_flag("--pieces", o->pieces, "one token per line: id and the text it stands for");
  app.add_flag("--special", o->special, "parse special-token text such as <|im_start|> as those tokens");
  return [o, p, f] {
    if (p->count() + f->count() == 0) fail(ErrorKind::Usage, "tokenize: give the text with -p TEXT or -f FILE");
    return run(*o);
  };
}}};

}  // namespace
}  // namespace baton
