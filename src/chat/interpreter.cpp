// Interpreter of the chat-template syntax tree: runs a Template over the render variables the
// way jinja2's compiled Python code would.
//
// Scoping follows jinja2: a for loop gives every iteration a fresh scope (a {% set %} inside
// does not survive the iteration, nor the loop), a macro call gets a scope whose parent is the
// scope the macro was defined in, and if / elif blocks share their parent's scope. Only
// namespace() objects carry values out of loops. Lookups go innermost scope -> template
// variables -> globals.
//
// Limits (RenderLimits): every statement and expression costs a step; macro calls nest at most
// max_call_depth deep; output buffers and string values stay under max_output_bytes.
#include <cmath>
#include <ctime>

#include "chat/jinja.h"

namespace moelora::chat::jinja {
namespace {

struct Frame {
  explicit Frame(std::shared_ptr<Frame> p) : parent(std::move(p)) {}
  std::shared_ptr<Frame> parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* find(std::string_view name) const {
    for (const Frame* f = this; f != nullptr; f = f->parent.get()) {
      for (const auto& [key, value] : f->vars) {
        if (key == name) return &value;
      }
    }
    return nullptr;
  }
  void set(const std::string& name, Value value) {
    for (auto& [key, existing] : vars) {
      if (key == name) {
        existing = std::move(value);
        return;
      }
    }
    vars.emplace_back(name, std::move(value));
  }
};
using FramePtr = std::shared_ptr<Frame>;

enum class Flow { kNormal, kBreak, kContinue };

// Adds the location of `at` to a TemplateError that has none yet (the innermost node wins).
template <typename Fn>
auto located(const Location& at, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (TemplateError& e) {
    if (e.line == 0) {
      e.line = at.line;
      e.column = at.column;
    }
    throw;
  }
}

class Interpreter {
 public:
  Interpreter(const RenderLimits& limits, const Object& variables) : limits_(limits) {
    root_ = std::make_shared<Frame>(nullptr);
    root_->vars.reserve(variables.size());
    for (const auto& [name, value] : variables.entries()) root_->vars.emplace_back(name, value);
    raise_exception_ = Value(std::make_shared<const Callable>(
        Callable{"raise_exception", [](CallArgs& args) -> Value {
                   check_arg_count(args, "raise_exception", 1, {});
                   const Value* message = find_arg(args, 0, "");
                   fail(ErrorCode::kInvalidArgument, message ? to_str(*message) : std::string());
                 }}));
    strftime_now_ = Value(std::make_shared<const Callable>(Callable{
        "strftime_now", [](CallArgs& args) -> Value {
          check_arg_count(args, "strftime_now", 1, {});
          const Value* format = find_arg(args, 0, "");
          if (format == nullptr || !format->is_string())
            type_error("strftime_now() expects a format string");
          const std::time_t now = std::time(nullptr);
          std::tm local{};
          localtime_r(&now, &local);
          char buf[512];
          const size_t n = std::strftime(buf, sizeof(buf), format->as_string().c_str(), &local);
          return Value(std::string(buf, n));
        }}));
    // namespace() as the builtin creates it, remembering each one for the destructor.
    namespace_ = Value(std::make_shared<const Callable>(
        Callable{"namespace", [this](CallArgs& args) -> Value {
                   Value ns = builtin_global("namespace").as_callable().call(args);
                   namespaces_.push_back(ns);
                   return ns;
                 }}));
  }

  // A namespace can hold itself ({% set ns.me = ns %}); emptying them all breaks such cycles,
  // which would otherwise outlive the render.
  ~Interpreter() {
    for (const Value& ns : namespaces_) ns.as_namespace().attributes = Object();
  }

  std::string run(const Template& tmpl) {
    std::string out;
    out_ = &out;
    exec_body(tmpl.body, root_);
    return out;
  }

 private:
  // ---- bookkeeping ----

  void step(uint64_t cost = 1) {
    steps_ += cost;
    if (steps_ > limits_.max_steps) {
      fail(ErrorCode::kOutOfRange,
           "template evaluation exceeded " + std::to_string(limits_.max_steps) + " steps");
    }
  }
  // A string of `bytes` is about to exist. Building strings costs steps too (one per 16 bytes),
  // so that a loop that keeps copying a long string (s = s ~ x) stops well before it has moved
  // gigabytes, even though each string stays under the size limit.
  void check_size(size_t bytes) {
    if (bytes > limits_.max_output_bytes) {
      fail(ErrorCode::kOutOfRange, "template output or string value exceeds " +
                                       std::to_string(limits_.max_output_bytes) + " bytes");
    }
    step(bytes / 16);
  }
  void emit(std::string_view text) {
    if (out_->size() + text.size() > limits_.max_output_bytes)
      check_size(out_->size() + text.size());
    step(text.size() / 16);
    out_->append(text);
  }

  // Runs `fn` with output going to a fresh buffer, which it returns.
  template <typename Fn>
  std::string capture(Fn&& fn) {
    std::string buffer;
    std::string* saved = out_;
    out_ = &buffer;
    try {
      fn();
    } catch (...) {
      out_ = saved;
      throw;
    }
    out_ = saved;
    return buffer;
  }

  Value lookup(const std::string& name, const FramePtr& frame) const {
    if (const Value* v = frame->find(name)) return *v;
    if (name == "raise_exception") return raise_exception_;
    if (name == "strftime_now") return strftime_now_;
    if (name == "namespace") return namespace_;
    Value global = builtin_global(name);
    if (!global.is_undefined()) return global;
    return Value::undefined("'" + name + "' is undefined");
  }

  // ---- statements ----

  Flow exec_body(const Body& body, const FramePtr& frame) {
    NestGuard guard(nesting_);
    for (const StmtPtr& stmt : body) {
      const Flow flow = located(stmt->loc, [&] { return exec(*stmt, frame); });
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& s, const FramePtr& frame) {
    step();
    switch (s.kind) {
      case StmtKind::kText: emit(s.text); return Flow::kNormal;
      case StmtKind::kOutput: {
        const Value v = eval(*s.expr, frame);
        if (v.is_string()) {
          emit(v.as_string());
        } else {
          emit(to_str(v));
        }
        return Flow::kNormal;
      }
      case StmtKind::kIf:
        for (const auto& [condition, body] : s.branches) {
          if (eval(*condition, frame).truthy()) return exec_body(body, frame);
        }
        return exec_body(s.else_body, frame);
      case StmtKind::kFor: return exec_for(s, frame);
      case StmtKind::kSet: assign(s.target, eval(*s.expr, frame), frame); return Flow::kNormal;
      case StmtKind::kSetBlock: {  // a break / continue inside leaves before the assignment
        Flow flow = Flow::kNormal;
        Value text(capture([&] { flow = exec_body(s.body, frame); }));
        if (flow != Flow::kNormal) return flow;
        if (s.expr) text = apply_filter_chain(*s.expr, frame, text);
        assign(s.target, std::move(text), frame);
        return Flow::kNormal;
      }
      case StmtKind::kMacro: frame->set(s.name, make_macro(s, frame)); return Flow::kNormal;
      case StmtKind::kCallBlock: {
        Value caller = make_caller(s, frame);
        const Value result = eval_call(*s.expr, frame, &caller);
        emit(to_str(result));
        return Flow::kNormal;
      }
      case StmtKind::kFilterBlock: {
        Flow flow = Flow::kNormal;
        const Value text(capture([&] { flow = exec_body(s.body, frame); }));
        if (flow != Flow::kNormal) return flow;
        emit(to_str(apply_filter_chain(*s.expr, frame, text)));
        return Flow::kNormal;
      }
      case StmtKind::kBreak: return Flow::kBreak;
      case StmtKind::kContinue: return Flow::kContinue;
      case StmtKind::kWith: {
        auto scope = std::make_shared<Frame>(frame);
        for (const auto& [name, expr] : s.assignments) scope->set(name, eval(*expr, frame));
        return exec_body(s.body, scope);
      }
      case StmtKind::kPassthrough: return exec_body(s.body, frame);
    }
    return Flow::kNormal;
  }

  void assign(const Target& target, Value value, const FramePtr& frame) {
    switch (target.kind) {
      case Target::Kind::kName: frame->set(target.names[0], std::move(value)); return;
      case Target::Kind::kTuple: {
        const Array items = iterate(value);
        if (items.size() != target.names.size()) {
          type_error(std::string(items.size() > target.names.size() ? "too many" : "not enough") +
                     " values to unpack (expected " + std::to_string(target.names.size()) +
                     ", got " + std::to_string(items.size()) + ")");
        }
        for (size_t i = 0; i < items.size(); ++i) frame->set(target.names[i], items[i]);
        return;
      }
      case Target::Kind::kAttribute: {
        const Value ns = lookup(target.names[0], frame);
        if (!ns.is_namespace()) {
          fail(ErrorCode::kInvalidArgument,
               "cannot assign attribute on non-namespace object '" + target.names[0] + "'");
        }
        ns.as_namespace().attributes.set(target.names[1], std::move(value));
        return;
      }
    }
  }

  Flow exec_for(const Stmt& s, const FramePtr& frame) {
    const Value iterable = eval(*s.expr, frame);
    Array items = iterate(iterable);
    if (s.condition) {  // {% for x in xs if cond %}: loop.* counts the kept items only
      Array kept;
      for (Value& item : items) {
        auto scope = std::make_shared<Frame>(frame);
        assign(s.target, item, scope);
        if (eval(*s.condition, scope).truthy()) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      auto scope = std::make_shared<Frame>(frame);
      exec_body(s.else_body, scope);
      return Flow::kNormal;
    }
    const auto n = static_cast<int64_t>(items.size());
    auto position = std::make_shared<int64_t>(0);
    const Value cycle(std::make_shared<const Callable>(
        Callable{"loop.cycle", [position](CallArgs& args) -> Value {
                   if (args.positional.empty()) type_error("no items for cycling given");
                   return args.positional[static_cast<size_t>(*position) % args.positional.size()];
                 }}));
    for (int64_t i = 0; i < n; ++i) {
      step();
      *position = i;
      auto scope = std::make_shared<Frame>(frame);
      Object loop;
      loop.set("index", Value(i + 1));
      loop.set("index0", Value(i));
      loop.set("revindex", Value(n - i));
      loop.set("revindex0", Value(n - i - 1));
      loop.set("first", Value(i == 0));
      loop.set("last", Value(i == n - 1));
      loop.set("length", Value(n));
      loop.set("depth", Value(int64_t{1}));
      loop.set("depth0", Value(int64_t{0}));
      if (i > 0) loop.set("previtem", items[i - 1]);
      if (i + 1 < n) loop.set("nextitem", items[i + 1]);
      loop.set("cycle", cycle);
      scope->vars.emplace_back("loop", Value(std::move(loop)));
      assign(s.target, items[i], scope);
      if (exec_body(s.body, scope) == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  // ---- macros ----

  // A macro (or a call block's caller()) keeps only a weak reference to the scope it was defined
  // in: the scope may hold the macro itself, and a strong one would make a cycle that outlives
  // the render. `closures_` keeps the scopes alive until the render ends.
  Value make_macro(const Stmt& def, const FramePtr& closure) {
    closures_.push_back(closure);
    std::weak_ptr<Frame> weak = closure;
    return Value(std::make_shared<const Callable>(Callable{
        def.kind == StmtKind::kMacro ? def.name : "caller", [this, &def, weak](CallArgs& args) {
          const FramePtr scope = weak.lock();
          if (!scope) fail(ErrorCode::kInternal, "macro scope released during the render");
          return call_macro(def, scope, args);
        }}));
  }
  Value make_caller(const Stmt& block, const FramePtr& frame) { return make_macro(block, frame); }

  // Binds the arguments as jinja2 does (missing ones are undefined, extra ones go to varargs /
  // kwargs when the body reads them) and renders the body; the text is the call's value.
  Value call_macro(const Stmt& def, const FramePtr& closure, CallArgs& args) {
    if (call_depth_ >= limits_.max_call_depth) {
      fail(ErrorCode::kOutOfRange,
           "macro calls nested deeper than " + std::to_string(limits_.max_call_depth) + " levels");
    }
    const std::string what = def.kind == StmtKind::kMacro ? "macro '" + def.name + "'" : "caller()";
    if (args.positional.size() > def.params.size() && !def.uses_varargs) {
      type_error(what + " takes not more than " + std::to_string(def.params.size()) +
                 " argument(s)");
    }
    auto scope = std::make_shared<Frame>(closure);
    std::vector<bool> bound(def.params.size(), false);
    Array varargs;
    Object kwargs;
    for (size_t i = 0; i < args.positional.size(); ++i) {
      if (i >= def.params.size()) {
        varargs.push_back(std::move(args.positional[i]));
        continue;
      }
      scope->set(def.params[i].name, std::move(args.positional[i]));
      bound[i] = true;
    }
    Value caller_value;
    for (auto& [name, value] : args.keyword) {
      size_t i = 0;
      while (i < def.params.size() && def.params[i].name != name) ++i;
      if (i == def.params.size()) {
        if (name == "caller" && def.kind == StmtKind::kMacro) {
          caller_value = std::move(value);
          continue;
        }
        if (def.uses_kwargs) {
          kwargs.set(name, std::move(value));
          continue;
        }
        type_error(what + " takes no keyword argument '" + name + "'");
      }
      if (bound[i]) type_error(what + " got multiple values for argument '" + name + "'");
      scope->set(name, std::move(value));
      bound[i] = true;
    }
    for (size_t i = 0; i < def.params.size(); ++i) {  // defaults see the earlier parameters
      if (bound[i]) continue;
      const MacroParam& p = def.params[i];
      scope->set(p.name, p.default_value
                             ? eval(*p.default_value, scope)
                             : Value::undefined("parameter '" + p.name + "' was not provided"));
    }
    if (!caller_value.is_undefined()) scope->set("caller", std::move(caller_value));
    if (def.uses_varargs) scope->set("varargs", Value::tuple(std::move(varargs)));
    if (def.uses_kwargs) scope->set("kwargs", Value(std::move(kwargs)));
    ++call_depth_;
    std::string text;
    try {
      text = capture([&] { exec_body(def.body, scope); });
    } catch (...) {
      --call_depth_;
      throw;
    }
    --call_depth_;
    return Value(std::move(text));
  }

  // ---- expressions ----

  // Every expression (and statement) evaluation nests one level; the bound keeps macros
  // called from deeply nested expressions from exhausting the C++ stack.
  struct NestGuard {
    explicit NestGuard(int& depth) : depth_(depth) {
      if (++depth_ > kMaxEvalNesting) {
        --depth_;
        fail(ErrorCode::kOutOfRange, "template evaluation nested deeper than " +
                                         std::to_string(kMaxEvalNesting) + " levels");
      }
    }
    ~NestGuard() { --depth_; }
    int& depth_;
  };
  static constexpr int kMaxEvalNesting = 500;  // about 0.4 MB of stack at the limit

  Value eval(const Expr& e, const FramePtr& frame) {
    return located(e.loc, [&] {
      NestGuard guard(nesting_);
      return eval_node(e, frame);
    });
  }

  CallArgs eval_args(const Expr& e, const FramePtr& frame) {
    CallArgs args;
    args.positional.reserve(e.items.size());
    for (const ExprPtr& item : e.items) args.positional.push_back(eval(*item, frame));
    for (const Keyword& kw : e.keywords) args.keyword.emplace_back(kw.name, eval(*kw.value, frame));
    return args;
  }

  Value eval_node(const Expr& e, const FramePtr& frame) {
    step();
    switch (e.kind) {
      case ExprKind::kConst: return e.constant;
      case ExprKind::kName: return lookup(e.name, frame);
      case ExprKind::kList:
      case ExprKind::kTuple: {
        Array items;
        items.reserve(e.items.size());
        for (const ExprPtr& item : e.items) items.push_back(eval(*item, frame));
        return e.kind == ExprKind::kTuple ? Value::tuple(std::move(items))
                                          : Value(std::move(items));
      }
      case ExprKind::kDict: {
        Object o;
        for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
          const Value key = eval(*e.items[i], frame);
          if (!key.is_string()) {
            fail(ErrorCode::kUnsupported,
                 std::string("dict literal keys must be strings, got ") + type_name(key));
          }
          o.set(key.as_string(), eval(*e.items[i + 1], frame));
        }
        return Value(std::move(o));
      }
      case ExprKind::kAttr: {
        const Value obj = eval(*e.operand, frame);
        require_defined(obj);
        return get_attribute(obj, e.name);
      }
      case ExprKind::kItem: {
        const Value obj = eval(*e.operand, frame);
        require_defined(obj);
        return get_item(obj, eval(*e.items[0], frame));
      }
      case ExprKind::kSlice: {
        const Value obj = eval(*e.operand, frame);
        require_defined(obj);
        Value bounds[3];
        for (int i = 0; i < 3; ++i) {
          if (e.items[i]) bounds[i] = eval(*e.items[i], frame);
        }
        return slice(obj, bounds[0], bounds[1], bounds[2]);
      }
      case ExprKind::kCall: return eval_call(e, frame, nullptr);
      case ExprKind::kFilter: {
        const Value operand = e.operand ? eval(*e.operand, frame) : block_input_;
        CallArgs args = eval_args(e, frame);
        Value result = apply_filter(e.name, operand, args, limits_.max_output_bytes);
        if (result.is_string()) check_size(result.as_string().size());
        return result;
      }
      case ExprKind::kTest: {
        const Value operand = eval(*e.operand, frame);
        CallArgs args = eval_args(e, frame);
        return Value(apply_test(e.name, operand, args));
      }
      case ExprKind::kNeg:
      case ExprKind::kPos: {
        const Value v = eval(*e.operand, frame);
        require_defined(v);
        if (!v.is_number()) {
          type_error(std::string("bad operand type for unary ") +
                     (e.kind == ExprKind::kNeg ? "-" : "+") + ": '" + type_name(v) + "'");
        }
        if (e.kind == ExprKind::kPos) return v.is_bool() ? Value(v.as_int()) : v;
        if (v.is_float()) return Value(-v.as_float());
        if (v.as_int() == INT64_MIN) fail(ErrorCode::kOutOfRange, "integer overflow");
        return Value(-v.as_int());
      }
      case ExprKind::kNot: return Value(!eval(*e.operand, frame).truthy());
      case ExprKind::kAnd: {
        Value left = eval(*e.items[0], frame);
        return left.truthy() ? eval(*e.items[1], frame) : left;
      }
      case ExprKind::kOr: {
        Value left = eval(*e.items[0], frame);
        return left.truthy() ? left : eval(*e.items[1], frame);
      }
      case ExprKind::kConcat: {
        std::string text = to_str(eval(*e.items[0], frame));
        text += to_str(eval(*e.items[1], frame));
        check_size(text.size());
        return Value(std::move(text));
      }
      case ExprKind::kBinary: {
        const Value left = eval(*e.items[0], frame);
        const Value right = eval(*e.items[1], frame);
        return binary(e.name, left, right);
      }
      case ExprKind::kCompare: {
        Value left = eval(*e.items[0], frame);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.items[i + 1], frame);
          if (!compare(e.ops[i], left, right)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case ExprKind::kCondExpr:
        if (eval(*e.items[0], frame).truthy()) return eval(*e.items[1], frame);
        return e.items[2] ? eval(*e.items[2], frame)
                          : Value::undefined("the condition was false and there is no else");
    }
    return Value();
  }

  // A call; `caller` is the body of an enclosing {% call %} block.
  Value eval_call(const Expr& e, const FramePtr& frame, const Value* caller) {
    return located(e.loc, [&]() -> Value {
      Value callee;
      if (e.operand->kind == ExprKind::kAttr) {  // obj.method(...): str / dict / list methods first
        const Value obj = eval(*e.operand->operand, frame);
        require_defined(obj);
        CallArgs args = eval_args(e, frame);
        Value result;
        if (call_method(obj, e.operand->name, args, limits_.max_output_bytes, result)) {
          if (result.is_string()) check_size(result.as_string().size());
          return result;
        }
        callee = get_attribute(obj, e.operand->name);
        return call_value(callee, args, caller);
      }
      callee = eval(*e.operand, frame);
      CallArgs args = eval_args(e, frame);
      return call_value(callee, args, caller);
    });
  }

  Value call_value(const Value& callee, CallArgs& args, const Value* caller) {
    require_defined(callee);
    if (!callee.is_callable())
      type_error(std::string("'") + type_name(callee) + "' object is not callable");
    if (caller != nullptr) args.keyword.emplace_back("caller", *caller);
    return callee.as_callable().call(args);
  }

  // The filters of a {% filter %} / {% set x | f %} block over `input`.
  Value apply_filter_chain(const Expr& chain, const FramePtr& frame, const Value& input) {
    const Value saved = block_input_;
    block_input_ = input;
    Value result;
    try {
      result = eval(chain, frame);
    } catch (...) {
      block_input_ = saved;
      throw;
    }
    block_input_ = saved;
    return result;
  }

  bool compare(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equals(a, b);
    if (op == "!=") return !equals(a, b);
    if (op == "<") return less_than(a, b);
    if (op == ">") return less_than(b, a);
    if (op == "<=") return !less_than(b, a);
    if (op == ">=") return !less_than(a, b);
    if (op == "in") return contains(b, a);
    return !contains(b, a);  // notin
  }

  Value binary(const std::string& op, const Value& a, const Value& b) {
    require_defined(a);
    require_defined(b);
    const auto unsupported = [&]() -> Value {
      type_error("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" +
                 type_name(b) + "'");
    };
    const bool ints = a.is_number() && b.is_number() && !a.is_float() && !b.is_float();
    const bool numbers = a.is_number() && b.is_number();
    const auto overflow = []() -> Value { fail(ErrorCode::kOutOfRange, "integer overflow"); };
    if (op == "+") {
      if (ints) {
        int64_t r;
        return __builtin_add_overflow(a.as_int(), b.as_int(), &r) ? overflow() : Value(r);
      }
      if (numbers) return Value(a.as_float() + b.as_float());
      if (a.is_string() && b.is_string()) {
        check_size(a.as_string().size() + b.as_string().size());
        return Value(a.as_string() + b.as_string());
      }
      if (a.is_array() && b.is_array() && a.is_tuple() == b.is_tuple()) {
        Array items = a.as_array();
        items.insert(items.end(), b.as_array().begin(), b.as_array().end());
        return a.is_tuple() ? Value::tuple(std::move(items)) : Value(std::move(items));
      }
      return unsupported();
    }
    if (op == "-") {
      if (ints) {
        int64_t r;
        return __builtin_sub_overflow(a.as_int(), b.as_int(), &r) ? overflow() : Value(r);
      }
      return numbers ? Value(a.as_float() - b.as_float()) : unsupported();
    }
    if (op == "*") {
      if (ints) {
        int64_t r;
        return __builtin_mul_overflow(a.as_int(), b.as_int(), &r) ? overflow() : Value(r);
      }
      if (numbers) return Value(a.as_float() * b.as_float());
      const Value* seq = a.is_number() ? &b : &a;
      const Value* count = a.is_number() ? &a : &b;
      if (count->is_float() || !count->is_number()) return unsupported();
      const int64_t n = std::max<int64_t>(count->as_int(), 0);
      if (seq->is_string()) {
        const size_t unit = seq->as_string().size();
        if (unit > 0 && static_cast<uint64_t>(n) > limits_.max_output_bytes / unit)
          check_size(SIZE_MAX);
        std::string text;
        for (int64_t i = 0; i < n; ++i) text += seq->as_string();
        return Value(std::move(text));
      }
      if (seq->is_array()) {
        const size_t unit = seq->as_array().size();
        if (unit > 0 && static_cast<uint64_t>(n) > limits_.max_output_bytes / unit)
          check_size(SIZE_MAX);
        Array items;
        for (int64_t i = 0; i < n; ++i)
          items.insert(items.end(), seq->as_array().begin(), seq->as_array().end());
        return seq->is_tuple() ? Value::tuple(std::move(items)) : Value(std::move(items));
      }
      return unsupported();
    }
    if (op == "/") {
      if (!numbers) return unsupported();
      if (b.as_float() == 0.0) type_error("division by zero");
      return Value(a.as_float() / b.as_float());
    }
    if (op == "//" || op == "%") {
      if (a.is_string() && op == "%") {
        fail(ErrorCode::kUnsupported, "printf-style '%' string formatting is not supported");
      }
      if (!numbers) return unsupported();
      if (ints) {
        const int64_t x = a.as_int();
        const int64_t y = b.as_int();
        if (y == 0) type_error("integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) return op == "%" ? Value(int64_t{0}) : overflow();
        int64_t q = x / y;
        int64_t r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) {  // Python rounds toward negative infinity
          --q;
          r += y;
        }
        return op == "//" ? Value(q) : Value(r);
      }
      // CPython's float_divmod.
      const double x = a.as_float();
      const double y = b.as_float();
      if (y == 0.0) type_error("float divmod()");
      double mod = std::fmod(x, y);
      double div = (x - mod) / y;
      if (mod != 0.0) {
        if ((y < 0) != (mod < 0)) {
          mod += y;
          div -= 1.0;
        }
      } else {
        mod = std::copysign(0.0, y);
      }
      double floordiv = std::copysign(0.0, x / y);
      if (div != 0.0) {
        floordiv = std::floor(div);
        if (div - floordiv > 0.5) floordiv += 1.0;
      }
      return op == "//" ? Value(floordiv) : Value(mod);
    }
    if (op == "**") {
      if (!numbers) return unsupported();
      if (ints && b.as_int() >= 0) {
        int64_t result = 1;
        int64_t base = a.as_int();
        int64_t exponent = b.as_int();
        while (exponent > 0) {
          if ((exponent & 1) && __builtin_mul_overflow(result, base, &result)) return overflow();
          exponent >>= 1;
          if (exponent > 0 && __builtin_mul_overflow(base, base, &base)) return overflow();
        }
        return Value(result);
      }
      if (a.as_float() == 0.0 && b.as_float() < 0)
        type_error("0.0 cannot be raised to a negative power");
      const double r = std::pow(a.as_float(), b.as_float());
      if (std::isinf(r) && std::isfinite(a.as_float()) && std::isfinite(b.as_float())) {
        fail(ErrorCode::kOutOfRange, "float power overflow");  // Python's OverflowError
      }
      return Value(r);
    }
    return unsupported();
  }

  const RenderLimits& limits_;
  FramePtr root_;
  std::vector<FramePtr> closures_;
  Value raise_exception_;
  Value strftime_now_;
  Value block_input_;
  std::string* out_ = nullptr;
  uint64_t steps_ = 0;
  int call_depth_ = 0;
  int nesting_ = 0;
  Value namespace_;
  std::vector<Value> namespaces_;
};

}  // namespace

std::string render(const Template& tmpl, const Object& variables, const RenderLimits& limits) {
  Interpreter interpreter(limits, variables);
  return interpreter.run(tmpl);
}

}  // namespace moelora::chat::jinja
