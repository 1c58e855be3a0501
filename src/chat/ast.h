// Syntax tree of a parsed chat template (parser.cpp builds it, interpreter.cpp runs it).
//
// One node struct per category (expression, statement) with a kind tag keeps the tree small and
// the evaluator a plain switch; each field's comment says which kinds use it. Every node keeps
// the line and column of the token it starts at, for error messages.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/value.h"

namespace moelora::chat::jinja {

struct Location {
  int line = 0;
  int column = 0;
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

enum class ExprKind {
  kConst,     // constant
  kName,      // name
  kList,      // [items...]
  kTuple,     // (items...), a Python tuple
  kDict,      // {items[0]: items[1], items[2]: items[3], ...}
  kAttr,      // operand.name
  kItem,      // operand[items[0]]
  kSlice,     // operand[items[0]:items[1]:items[2]] (null items are omitted bounds)
  kCall,      // operand(items..., keywords...)
  kFilter,    // operand | name(items..., keywords...); operand null inside {% filter %} blocks
  kTest,      // operand is name(items...)
  kNeg,       // -operand
  kPos,       // +operand
  kNot,       // not operand
  kBinary,    // items[0] name items[1] for name in + - * / // % **
  kConcat,    // items[0] ~ items[1]
  kAnd,       // items[0] and items[1]
  kOr,        // items[0] or items[1]
  kCompare,   // items[0] ops[0] items[1] ops[1] items[2] ... (==, !=, <, <=, >, >=, in, notin)
  kCondExpr,  // items[1] if items[0] else items[2] (items[2] null: undefined)
};

struct Keyword {
  std::string name;
  ExprPtr value;
};

struct Expr {
  ExprKind kind;
  Location loc;
  Value constant;                 // kConst
  std::string name;               // kName, kAttr, kFilter, kTest, kBinary
  ExprPtr operand;                // kAttr, kItem, kSlice, kCall, kFilter, kTest, kNeg, kPos, kNot
  std::vector<ExprPtr> items;     // see ExprKind
  std::vector<Keyword> keywords;  // kCall, kFilter, kTest
  std::vector<std::string> ops;   // kCompare
};

// Left-hand side of set / for: a name, names to unpack, or namespace.attribute.
struct Target {
  enum class Kind { kName, kTuple, kAttribute };
  Kind kind = Kind::kName;
  std::vector<std::string> names;  // kName: one; kTuple: several; kAttribute: {object, attribute}
  Location loc;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: undefined when the caller does not pass it
};

enum class StmtKind {
  kText,         // text
  kOutput,       // {{ expr }}
  kIf,           // branches (condition, body)..., else_body
  kFor,          // {% for target in expr [if condition] %} body {% else %} else_body
  kSet,          // {% set target = expr %}
  kSetBlock,     // {% set target [| filters in expr] %} body {% endset %}
  kMacro,        // {% macro name(params) %} body
  kCallBlock,    // {% call[(params)] expr %} body: expr is a kCall, body becomes caller()
  kFilterBlock,  // {% filter expr %} body: expr is a kFilter chain applied to the body's output
  kBreak,
  kContinue,
  kWith,         // {% with assignments %} body
  kPassthrough,  // {% generation %} body (transformers' assistant-mask marker): just the body
};

struct Stmt {
  StmtKind kind;
  Location loc;
  std::string text;
  ExprPtr expr;
  ExprPtr condition;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  Target target;
  std::string name;
  std::vector<MacroParam> params;
  std::vector<std::pair<std::string, ExprPtr>> assignments;
  // kMacro / kCallBlock: the body reads `varargs` / `kwargs`, so extra positional / keyword
  // arguments are collected there instead of being an error (jinja2's rule).
  bool uses_varargs = false;
  bool uses_kwargs = false;
};

// A parsed template: immutable, shared by every render.
struct Template {
  Body body;
};

}  // namespace moelora::chat::jinja
