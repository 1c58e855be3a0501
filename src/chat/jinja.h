// Internal interface of the chat-template interpreter, a Jinja2 subset sized to what Hugging Face
// chat templates use (chat_template.h is the public API on top of it):
//
//   parse()   source -> Template (lexer.cpp, parser.cpp); syntax errors, unknown filters and
//             tests fail here, as they do when jinja2 compiles a template;
//   render()  Template + variables -> text (interpreter.cpp), with the filters and tests of
//             filters.cpp and the methods and globals of builtins.cpp.
//
// The environment is the one transformers builds: ImmutableSandboxedEnvironment with
// trim_blocks, lstrip_blocks and the loopcontrols extension (break / continue), its own tojson
// filter (json.dumps, ensure_ascii=False) and the raise_exception / strftime_now globals.
// Everything throws TemplateError (value.h); ChatTemplate turns it into moelora::Error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>

#include "chat/ast.h"
#include "chat/chat_template.h"
#include "chat/value.h"

namespace moelora::chat::jinja {

using RenderLimits = moelora::chat::RenderLimits;

// Nesting limit of the parser (brackets, statements), against stack exhaustion.
inline constexpr int kMaxNesting = 200;

std::shared_ptr<const Template> parse(std::string_view source);

// `variables` are the template's context (messages, tools, add_generation_prompt, bos_token,
// ...); the globals (range, namespace, dict, raise_exception, strftime_now) come on top.
std::string render(const Template& tmpl, const Object& variables, const RenderLimits& limits = {});

// ---- filters and tests (filters.cpp) ----

bool has_filter(std::string_view name);
bool has_test(std::string_view name);
// `max_string` bounds the strings a filter may build (RenderLimits::max_output_bytes).
Value apply_filter(std::string_view name, const Value& operand, CallArgs& args, size_t max_string);
bool apply_test(std::string_view name, const Value& operand, CallArgs& args);

// ---- methods and globals (builtins.cpp) ----

// obj.name(args) for the str / dict / list methods templates use. Returns false when `obj` has no
// such method (the caller then looks the attribute up); fails for mutating list / dict methods,
// which the immutable sandbox refuses.
bool call_method(const Value& obj, std::string_view name, CallArgs& args, size_t max_string,
                 Value& result);
// range(), namespace(), dict() (the globals that need no renderer state).
Value builtin_global(std::string_view name);

// Argument helpers shared by filters, methods and globals: positional `index` or keyword `name`.
const Value* find_arg(const CallArgs& args, size_t index, std::string_view name);
void check_arg_count(const CallArgs& args, std::string_view what, size_t max_positional,
                     std::initializer_list<std::string_view> keywords);

// Python semantics shared by the interpreter and the filters.
Array iterate(const Value& v);  // list(v): items, dict keys, characters; fails for non-iterables
// jinja2 environment.getattr: Python getattr (methods, namespace attributes), then dict keys
// unless `items_too` is false (the attr filter).
Value get_attribute(const Value& obj, std::string_view name, bool items_too = true);
Value get_item(const Value& obj, const Value& key);  // jinja2 environment.getitem
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
int64_t length(const Value& v);                            // len(v)
bool contains(const Value& container, const Value& item);  // item in container

}  // namespace moelora::chat::jinja
