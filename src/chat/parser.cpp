// Parser of the chat-template interpreter: tokens (lexer.cpp) -> syntax tree (ast.h).
//
// A recursive-descent copy of jinja2's parser (jinja2/parser.py) for the statements templates use
// (if, for, set, macro, call, filter, with, break, continue, generation) and the full expression
// grammar, with jinja2's precedence, lowest first:
//   x if c else y | or | and | not | comparisons, in, not in | + - | ~ | * / // % | ** |
//   unary - + | primary with .attr [index] [a:b:c] (call) and | filter / is test
// Filters and tests are checked against the known ones here, as jinja2 does at compile time, so a
// template using something this interpreter lacks fails when it is loaded, not mid-request.
#include <initializer_list>

#include "chat/jinja.h"
#include "chat/lexer.h"

namespace moelora::chat::jinja {
namespace {

// Whether `name` is read anywhere in an expression / statement list (macro varargs / kwargs).
bool mentions(const Expr* e, std::string_view name) {
  if (e == nullptr) return false;
  if (e->kind == ExprKind::kName && e->name == name) return true;
  if (mentions(e->operand.get(), name)) return true;
  for (const ExprPtr& item : e->items) {
    if (mentions(item.get(), name)) return true;
  }
  for (const Keyword& kw : e->keywords) {
    if (mentions(kw.value.get(), name)) return true;
  }
  return false;
}

bool mentions(const Body& body, std::string_view name) {
  for (const StmtPtr& s : body) {
    if (mentions(s->expr.get(), name) || mentions(s->condition.get(), name) ||
        mentions(s->body, name) || mentions(s->else_body, name)) {
      return true;
    }
    for (const auto& [condition, branch] : s->branches) {
      if (mentions(condition.get(), name) || mentions(branch, name)) return true;
    }
    for (const MacroParam& p : s->params) {
      if (mentions(p.default_value.get(), name)) return true;
    }
    for (const auto& [target, value] : s->assignments) {
      if (mentions(value.get(), name)) return true;
    }
  }
  return false;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  std::shared_ptr<const Template> run() {
    auto tmpl = std::make_shared<Template>();
    tmpl->body = parse_body({});
    return tmpl;
  }

 private:
  // ---- token helpers ----
  const Token& current() const { return tokens_[pos_]; }
  const Token& peek(size_t ahead = 1) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  const Token& next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  static Location loc(const Token& t) { return {t.line, t.column}; }

  [[noreturn]] void error_at(const Token& t, std::string message) const {
    throw TemplateError{ErrorCode::kInvalidFile, std::move(message), t.line, t.column};
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case TokenType::kName:
      case TokenType::kOperator: return "'" + t.value + "'";
      case TokenType::kString: return "string";
      default: return token_type_name(t.type);
    }
  }
  bool is_op(const char* op) const {
    return current().type == TokenType::kOperator && current().value == op;
  }
  bool is_name(const char* name) const {
    return current().type == TokenType::kName && current().value == name;
  }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }
  void expect_op(const char* op) {
    if (!skip_op(op))
      error_at(current(), std::string("expected '") + op + "', got " + describe(current()));
  }
  const Token& expect(TokenType type, const char* what) {
    if (current().type != type)
      error_at(current(), std::string("expected ") + what + ", got " + describe(current()));
    return next();
  }
  void expect_block_end() { expect(TokenType::kBlockEnd, "end of statement block"); }

  struct DepthGuard {
    DepthGuard(Parser& p, const Token& at) : parser(p) {
      if (++parser.depth_ > kMaxNesting) {
        throw TemplateError{
            ErrorCode::kOutOfRange,
            "template nested deeper than " + std::to_string(kMaxNesting) + " levels", at.line,
            at.column};
      }
    }
    ~DepthGuard() { --parser.depth_; }
    Parser& parser;
  };

  static ExprPtr make(ExprKind kind, Location at) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->loc = at;
    return e;
  }
  static StmtPtr make_stmt(StmtKind kind, Location at) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->loc = at;
    return s;
  }

  // ---- statements ----

  // Statements up to one of the block tags in `end_names` (consumed up to and including the tag
  // name, which stays readable as tokens_[pos_ - 1]); end_names empty: up to the end.
  Body parse_body(std::initializer_list<const char*> end_names) {
    DepthGuard guard(*this, current());
    Body body;
    while (true) {
      const Token& t = current();
      if (t.type == TokenType::kEnd) {
        if (end_names.size() == 0) return body;
        std::string expected;
        for (const char* name : end_names)
          expected += std::string(expected.empty() ? "" : " or ") + "'" + name + "'";
        error_at(t, "unexpected end of template, expected " + expected);
      }
      if (t.type == TokenType::kData) {
        auto s = make_stmt(StmtKind::kText, loc(t));
        s->text = next().value;
        body.push_back(std::move(s));
      } else if (t.type == TokenType::kVariableBegin) {
        next();
        auto s = make_stmt(StmtKind::kOutput, loc(t));
        s->expr = parse_tuple(false);
        expect(TokenType::kVariableEnd, "end of print statement");
        body.push_back(std::move(s));
      } else if (t.type == TokenType::kBlockBegin) {
        next();
        const Token& name = current();
        if (name.type != TokenType::kName) error_at(name, "tag name expected");
        for (const char* end : end_names) {
          if (name.value == end) {
            next();
            return body;
          }
        }
        body.push_back(parse_statement());
      } else {
        error_at(t, "unexpected " + describe(t));
      }
    }
  }

  StmtPtr parse_statement() {
    const Token& t = next();
    const std::string& tag = t.value;
    if (tag == "if") return parse_if(t);
    if (tag == "for") return parse_for(t);
    if (tag == "set") return parse_set(t);
    if (tag == "macro") return parse_macro(t);
    if (tag == "call") return parse_call_block(t);
    if (tag == "filter") return parse_filter_block(t);
    if (tag == "with") return parse_with(t);
    if (tag == "generation") {
      auto s = make_stmt(StmtKind::kPassthrough, loc(t));
      expect_block_end();
      s->body = parse_body({"endgeneration"});
      expect_block_end();
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) error_at(t, "'" + tag + "' outside of a loop");
      auto s = make_stmt(tag == "break" ? StmtKind::kBreak : StmtKind::kContinue, loc(t));
      expect_block_end();
      return s;
    }
    if (tag == "include" || tag == "import" || tag == "from" || tag == "extends" ||
        tag == "block") {
      throw TemplateError{ErrorCode::kUnsupported,
                          "'" + tag + "' is not supported in chat templates (no template loader)",
                          t.line, t.column};
    }
    error_at(t, "encountered unknown tag '" + tag + "'");
  }

  StmtPtr parse_if(const Token& t) {
    auto s = make_stmt(StmtKind::kIf, loc(t));
    ExprPtr condition = parse_tuple(false, /*with_condexpr=*/false);
    while (true) {
      expect_block_end();
      Body body = parse_body({"elif", "else", "endif"});
      s->branches.emplace_back(std::move(condition), std::move(body));
      const std::string& tag = tokens_[pos_ - 1].value;
      if (tag == "elif") {
        condition = parse_tuple(false, /*with_condexpr=*/false);
        continue;
      }
      if (tag == "else") {
        expect_block_end();
        s->else_body = parse_body({"endif"});
      }
      expect_block_end();
      return s;
    }
  }

  StmtPtr parse_for(const Token& t) {
    auto s = make_stmt(StmtKind::kFor, loc(t));
    s->target = parse_target(false);
    if (!skip_name("in")) error_at(current(), "expected 'in', got " + describe(current()));
    s->expr = parse_tuple(false, /*with_condexpr=*/false);
    if (skip_name("if")) s->condition = parse_expression(true);
    if (is_name("recursive")) {
      throw TemplateError{ErrorCode::kUnsupported, "recursive for loops are not supported",
                          current().line, current().column};
    }
    expect_block_end();
    ++loop_depth_;
    s->body = parse_body({"endfor", "else"});
    --loop_depth_;
    if (tokens_[pos_ - 1].value == "else") {
      expect_block_end();
      s->else_body = parse_body({"endfor"});
    }
    expect_block_end();
    return s;
  }

  StmtPtr parse_set(const Token& t) {
    Target target = parse_target(true);
    if (skip_op("=")) {
      auto s = make_stmt(StmtKind::kSet, loc(t));
      s->target = std::move(target);
      s->expr = parse_tuple(false);
      expect_block_end();
      return s;
    }
    auto s = make_stmt(StmtKind::kSetBlock, loc(t));
    if (target.kind != Target::Kind::kName) error_at(t, "block set needs a plain name");
    s->target = std::move(target);
    if (is_op("|")) s->expr = parse_filter_chain(nullptr);
    expect_block_end();
    s->body = parse_body({"endset"});
    expect_block_end();
    return s;
  }

  StmtPtr parse_macro(const Token& t) {
    auto s = make_stmt(StmtKind::kMacro, loc(t));
    s->name = expect(TokenType::kName, "macro name").value;
    parse_signature(s->params);
    expect_block_end();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_body({"endmacro"});
    loop_depth_ = saved;
    s->uses_varargs = mentions(s->body, "varargs");
    s->uses_kwargs = mentions(s->body, "kwargs");
    if (current().type == TokenType::kName && current().value == s->name) next();
    expect_block_end();
    return s;
  }

  void parse_signature(std::vector<MacroParam>& params) {
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      const Token& name = expect(TokenType::kName, "parameter name");
      MacroParam p{name.value, nullptr};
      if (skip_op("=")) p.default_value = parse_expression(true);
      for (const MacroParam& other : params) {
        if (other.name == p.name) error_at(name, "duplicate parameter '" + p.name + "'");
      }
      params.push_back(std::move(p));
    }
    next();
  }

  StmtPtr parse_call_block(const Token& t) {
    auto s = make_stmt(StmtKind::kCallBlock, loc(t));
    if (is_op("(")) parse_signature(s->params);
    s->expr = parse_expression(true);
    if (s->expr->kind != ExprKind::kCall) error_at(t, "expected a call after 'call'");
    expect_block_end();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_body({"endcall"});
    loop_depth_ = saved;
    s->uses_varargs = mentions(s->body, "varargs");
    s->uses_kwargs = mentions(s->body, "kwargs");
    expect_block_end();
    return s;
  }

  StmtPtr parse_filter_block(const Token& t) {
    auto s = make_stmt(StmtKind::kFilterBlock, loc(t));
    s->expr = parse_filter_chain(nullptr, /*leading_pipe=*/false);
    expect_block_end();
    s->body = parse_body({"endfilter"});
    expect_block_end();
    return s;
  }

  StmtPtr parse_with(const Token& t) {
    auto s = make_stmt(StmtKind::kWith, loc(t));
    while (current().type != TokenType::kBlockEnd) {
      if (!s->assignments.empty()) expect_op(",");
      const std::string name = expect(TokenType::kName, "name").value;
      expect_op("=");
      s->assignments.emplace_back(name, parse_expression(true));
    }
    expect_block_end();
    s->body = parse_body({"endwith"});
    expect_block_end();
    return s;
  }

  Target parse_target(bool allow_attribute) {
    Target target;
    target.loc = loc(current());
    const bool parenthesized = skip_op("(");
    while (true) {
      const Token& name = expect(TokenType::kName, "name");
      if (allow_attribute && !parenthesized && target.names.empty() && skip_op(".")) {
        target.kind = Target::Kind::kAttribute;
        target.names = {name.value, expect(TokenType::kName, "attribute name").value};
        return target;
      }
      target.names.push_back(name.value);
      if (!skip_op(",")) break;
      if (parenthesized && is_op(")")) break;
    }
    if (parenthesized) expect_op(")");
    target.kind =
        target.names.size() == 1 && !parenthesized ? Target::Kind::kName : Target::Kind::kTuple;
    return target;
  }

  // ---- expressions ----

  // jinja2 parse_tuple: one expression, or a tuple when commas follow; `()` only in parentheses.
  ExprPtr parse_tuple(bool explicit_parens_ok, bool with_condexpr = true) {
    const Location at = loc(current());
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        is_tuple = true;
      }
      if (tuple_ends()) break;
      items.push_back(parse_expression(with_condexpr));
    }
    if (!is_tuple) {
      if (items.empty()) {
        if (!explicit_parens_ok)
          error_at(current(), "expected an expression, got " + describe(current()));
        auto e = make(ExprKind::kTuple, at);
        return e;
      }
      return std::move(items.front());
    }
    auto e = make(ExprKind::kTuple, at);
    e->items = std::move(items);
    return e;
  }

  bool tuple_ends() const {
    const Token& t = current();
    if (t.type == TokenType::kVariableEnd || t.type == TokenType::kBlockEnd ||
        t.type == TokenType::kEnd)
      return true;
    return t.type == TokenType::kOperator && t.value == ")";
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this, current());
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    const Location at = loc(current());
    ExprPtr value = parse_or();
    while (skip_name("if")) {
      auto e = make(ExprKind::kCondExpr, at);
      ExprPtr condition = parse_or();
      ExprPtr otherwise = skip_name("else") ? parse_condexpr() : nullptr;
      e->items.push_back(std::move(condition));
      e->items.push_back(std::move(value));
      e->items.push_back(std::move(otherwise));
      value = std::move(e);
    }
    return value;
  }

  ExprPtr binary(ExprKind kind, Location at, ExprPtr left, ExprPtr right, std::string op = {}) {
    auto e = make(kind, at);
    e->name = std::move(op);
    e->items.push_back(std::move(left));
    e->items.push_back(std::move(right));
    return e;
  }

  ExprPtr parse_or() {
    const Location at = loc(current());
    ExprPtr left = parse_and();
    while (skip_name("or")) left = binary(ExprKind::kOr, at, std::move(left), parse_and());
    return left;
  }

  ExprPtr parse_and() {
    const Location at = loc(current());
    ExprPtr left = parse_not();
    while (skip_name("and")) left = binary(ExprKind::kAnd, at, std::move(left), parse_not());
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this, current());
      auto e = make(ExprKind::kNot, loc(next()));
      e->operand = parse_not();
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const Location at = loc(current());
    ExprPtr first = parse_math1();
    std::vector<std::string> ops;
    std::vector<ExprPtr> operands;
    while (true) {
      const Token& t = current();
      std::string op;
      if (t.type == TokenType::kOperator &&
          (t.value == "==" || t.value == "!=" || t.value == "<" || t.value == "<=" ||
           t.value == ">" || t.value == ">=")) {
        op = t.value;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && peek().type == TokenType::kName && peek().value == "in") {
        op = "notin";
        next();
        next();
      } else {
        break;
      }
      ops.push_back(op);
      operands.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto e = make(ExprKind::kCompare, at);
    e->items.push_back(std::move(first));
    for (auto& operand : operands) e->items.push_back(std::move(operand));
    e->ops = std::move(ops);
    return e;
  }

  ExprPtr parse_math1() {
    const Location at = loc(current());
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = next().value;
      left = binary(ExprKind::kBinary, at, std::move(left), parse_concat(), op);
    }
    return left;
  }

  ExprPtr parse_concat() {
    const Location at = loc(current());
    ExprPtr left = parse_math2();
    while (skip_op("~")) left = binary(ExprKind::kConcat, at, std::move(left), parse_math2());
    return left;
  }

  ExprPtr parse_math2() {
    const Location at = loc(current());
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = next().value;
      left = binary(ExprKind::kBinary, at, std::move(left), parse_pow(), op);
    }
    return left;
  }

  ExprPtr parse_pow() {
    const Location at = loc(current());
    ExprPtr left = parse_unary(true);
    while (skip_op("**"))
      left = binary(ExprKind::kBinary, at, std::move(left), parse_unary(true), "**");
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this, current());
    const Token& t = current();
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      next();
      node = make(t.value == "-" ? ExprKind::kNeg : ExprKind::kPos, loc(t));
      node->operand = parse_unary(false);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = current();
    switch (t.type) {
      case TokenType::kName: {
        next();
        if (t.value == "true" || t.value == "True" || t.value == "false" || t.value == "False") {
          auto e = make(ExprKind::kConst, loc(t));
          e->constant = Value(t.value == "true" || t.value == "True");
          return e;
        }
        if (t.value == "none" || t.value == "None") {
          auto e = make(ExprKind::kConst, loc(t));
          e->constant = Value::none();
          return e;
        }
        auto e = make(ExprKind::kName, loc(t));
        e->name = t.value;
        return e;
      }
      case TokenType::kString: {
        auto e = make(ExprKind::kConst, loc(t));
        std::string text;
        while (current().type == TokenType::kString)
          text += next().value;  // adjacent literals join
        e->constant = Value(std::move(text));
        return e;
      }
      case TokenType::kInteger:
      case TokenType::kFloat: {
        next();
        auto e = make(ExprKind::kConst, loc(t));
        e->constant = t.type == TokenType::kInteger ? Value(t.int_value) : Value(t.float_value);
        return e;
      }
      case TokenType::kOperator:
        if (t.value == "(") {
          next();
          ExprPtr e = parse_tuple(true);
          expect_op(")");
          return e;
        }
        if (t.value == "[") return parse_list();
        if (t.value == "{") return parse_dict();
        break;
      default: break;
    }
    error_at(t, "unexpected " + describe(t));
  }

  ExprPtr parse_list() {
    auto e = make(ExprKind::kList, loc(next()));
    while (!is_op("]")) {
      if (!e->items.empty()) {
        expect_op(",");
        if (is_op("]")) break;
      }
      e->items.push_back(parse_expression(true));
    }
    next();
    return e;
  }

  ExprPtr parse_dict() {
    auto e = make(ExprKind::kDict, loc(next()));
    while (!is_op("}")) {
      if (!e->items.empty()) {
        expect_op(",");
        if (is_op("}")) break;
      }
      e->items.push_back(parse_expression(true));
      expect_op(":");
      e->items.push_back(parse_expression(true));
    }
    next();
    return e;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filter_chain(std::move(node));
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const Token& t = next();
    if (t.value == ".") {
      const Token& attr = current();
      if (attr.type == TokenType::kName) {
        auto e = make(ExprKind::kAttr, loc(attr));
        e->name = next().value;
        e->operand = std::move(node);
        return e;
      }
      if (attr.type == TokenType::kInteger) {  // foo.0 is foo[0]
        auto e = make(ExprKind::kItem, loc(attr));
        e->operand = std::move(node);
        auto index = make(ExprKind::kConst, loc(attr));
        index->constant = Value(next().int_value);
        e->items.push_back(std::move(index));
        return e;
      }
      error_at(attr, "expected name or number after '.', got " + describe(attr));
    }
    // [index] or [start:stop:step]
    std::vector<ExprPtr> parts(1);
    bool is_slice = false;
    while (!is_op("]")) {
      if (skip_op(":")) {
        is_slice = true;
        if (parts.size() == 3) error_at(current(), "too many ':' in slice");
        parts.emplace_back();
        continue;
      }
      if (parts.back()) error_at(current(), "expected ']' or ':', got " + describe(current()));
      parts.back() = parse_expression(true);
    }
    next();
    if (!is_slice && !parts.front()) error_at(t, "expected an index expression");
    auto e = make(is_slice ? ExprKind::kSlice : ExprKind::kItem, loc(t));
    e->operand = std::move(node);
    if (is_slice) parts.resize(3);
    e->items = std::move(parts);
    return e;
  }

  void parse_call_args(std::vector<ExprPtr>& args, std::vector<Keyword>& keywords) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) {
        expect_op(",");
        if (is_op(")")) break;
      }
      first = false;
      if (is_op("*") || is_op("**")) {
        throw TemplateError{ErrorCode::kUnsupported, "*args / **kwargs in calls are not supported",
                            current().line, current().column};
      }
      if (current().type == TokenType::kName && peek().type == TokenType::kOperator &&
          peek().value == "=") {
        const std::string name = next().value;
        next();
        keywords.push_back({name, parse_expression(true)});
      } else {
        if (!keywords.empty()) error_at(current(), "positional argument after keyword argument");
        args.push_back(parse_expression(true));
      }
    }
    next();
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = make(ExprKind::kCall, node->loc);  // errors point at the callee
    e->operand = std::move(node);
    parse_call_args(e->items, e->keywords);
    return e;
  }

  // | name[(args)] | name2 ... ; `leading_pipe` false for {% filter name %}.
  ExprPtr parse_filter_chain(ExprPtr node, bool leading_pipe = true) {
    bool need_pipe = leading_pipe;
    do {
      if (need_pipe) expect_op("|");
      need_pipe = true;
      const Token& name = expect(TokenType::kName, "filter name");
      std::string full = name.value;
      while (is_op(".")) {
        next();
        full += "." + expect(TokenType::kName, "filter name").value;
      }
      if (!has_filter(full)) {
        throw TemplateError{ErrorCode::kUnsupported, "no filter named '" + full + "'", name.line,
                            name.column};
      }
      auto e = make(ExprKind::kFilter, loc(name));
      e->name = full;
      e->operand = std::move(node);
      if (is_op("(")) parse_call_args(e->items, e->keywords);
      node = std::move(e);
    } while (is_op("|"));
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    const Token& is = next();
    const bool negated = skip_name("not");
    const Token& name = expect(TokenType::kName, "test name");
    std::string full = name.value;
    while (is_op(".")) {
      next();
      full += "." + expect(TokenType::kName, "test name").value;
    }
    if (!has_test(full)) {
      throw TemplateError{ErrorCode::kUnsupported, "no test named '" + full + "'", name.line,
                          name.column};
    }
    auto e = make(ExprKind::kTest, loc(name));
    e->name = full;
    e->operand = std::move(node);
    const Token& t = current();
    if (is_op("(")) {
      parse_call_args(e->items, e->keywords);
    } else if ((t.type == TokenType::kName && t.value != "else" && t.value != "or" &&
                t.value != "and") ||
               t.type == TokenType::kString || t.type == TokenType::kInteger ||
               t.type == TokenType::kFloat || is_op("[") || is_op("{")) {
      // jinja2 takes one argument without parentheses: "x is divisibleby 3", "x is sameas none".
      if (is_name("is")) error_at(t, "you cannot chain multiple tests with 'is'");
      e->items.push_back(parse_postfix(parse_primary()));
    }
    if (!negated) return e;
    auto n = make(ExprKind::kNot, loc(is));
    n->operand = std::move(e);
    return n;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;  // break / continue are only valid inside a for body (not across macros)
};

}  // namespace

std::shared_ptr<const Template> parse(std::string_view source) {
  return Parser(tokenize(source)).run();
}

}  // namespace moelora::chat::jinja
