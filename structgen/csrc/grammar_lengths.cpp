// Each rule's shortest output in bytes, for grammar/termination.py, read from xgrammar's
// `Grammar.serialize_json()` text: the same fixpoint as `termination._shortest_lengths` (the
// Python there is the reference the tests compare this with), without the GIL.
//
// In a burst of new JSON schemas the Python fixpoint (and the JSON it reads) was the largest
// share of a compile's Python work, which every compile thread queued for one GIL; here one
// grammar takes tens of microseconds and ctypes lets the GIL go for the call.
//
// Only the fields the fixpoint needs are read ("rules": [[name, body, ...], ...],
// "grammar_expr_data", "grammar_expr_indptr", "root_rule_id"); every other value is skipped.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <queue>
#include <string>
#include <vector>

namespace {

constexpr int64_t NEVER = int64_t(1) << 40;  // termination.NEVER
constexpr int64_t MAX_CODEPOINT = 0x10FFFF;
enum Kind { BYTES, CLASS, CLASS_STAR, EMPTY, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT };

// A forward-only reader of one JSON text; any malformed input sets `bad` and stops.
struct Reader {
  const char* p;
  const char* end;
  bool bad = false;

  void space() {
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) ++p;
  }
  bool eat(char c) {
    space();
    if (p < end && *p == c) {
      ++p;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) bad = true;
  }
  std::string string() {
    std::string out;
    space();
    if (p >= end || *p != '"') {
      bad = true;
      return out;
    }
    for (++p; p < end && *p != '"'; ++p) {
      if (*p == '\\' && ++p >= end) break;
      out.push_back(*p);  // an escape's character as it is: keys here are plain names
    }
    if (p >= end) bad = true;
    else ++p;
    return out;
  }
  int64_t integer() {
    space();
    bool negative = p < end && *p == '-';
    if (negative) ++p;
    if (p >= end || *p < '0' || *p > '9') {
      bad = true;
      return 0;
    }
    int64_t v = 0;
    for (; p < end && *p >= '0' && *p <= '9'; ++p) {
      if (v > (INT64_MAX - 9) / 10) {
        bad = true;
        return 0;
      }
      v = v * 10 + (*p - '0');
    }
    return negative ? -v : v;
  }
  void skip() {  // any one value
    space();
    if (p >= end) {
      bad = true;
      return;
    }
    if (*p == '"') {
      string();
    } else if (*p == '[' || *p == '{') {
      char close = *p == '[' ? ']' : '}';
      bool object = *p == '{';
      ++p;
      if (eat(close)) return;
      do {
        if (object) {
          string();
          expect(':');
        }
        skip();
      } while (!bad && eat(','));
      expect(close);
    } else {
      while (p < end && *p != ',' && *p != ']' && *p != '}' && *p != ' ' && *p != '\n') ++p;
    }
  }
  std::vector<int64_t> integers() {
    std::vector<int64_t> out;
    expect('[');
    if (bad || eat(']')) return out;
    do out.push_back(integer());
    while (!bad && eat(','));
    expect(']');
    return out;
  }
  std::vector<int64_t> rule_bodies() {  // [[name, body, ...], ...] -> the bodies
    std::vector<int64_t> out;
    expect('[');
    if (bad || eat(']')) return out;
    do {
      expect('[');
      string();
      expect(',');
      out.push_back(integer());
      while (!bad && eat(',')) skip();
      expect(']');
    } while (!bad && eat(','));
    expect(']');
    return out;
  }
};

struct Grammar {
  std::vector<int64_t> bodies, data, indptr;
  int64_t root = -1;
  mutable int64_t visits = 0;  // expressions evaluated: the work the caller's limit bounds

  bool read(const char* text, int64_t n) {
    Reader r{text, text + n};
    r.expect('{');
    if (!r.bad && r.eat('}')) return false;
    do {
      std::string key = r.string();
      r.expect(':');
      if (r.bad) break;
      if (key == "rules") bodies = r.rule_bodies();
      else if (key == "grammar_expr_data") data = r.integers();
      else if (key == "grammar_expr_indptr") indptr = r.integers();
      else if (key == "root_rule_id") root = r.integer();
      else r.skip();
    } while (!r.bad && r.eat(','));
    r.expect('}');
    return !r.bad && valid();
  }
  bool valid() const {
    int64_t rules = bodies.size(), exprs = indptr.size();
    if (root < 0 || root >= rules) return false;
    for (size_t i = 0; i < indptr.size(); ++i) {
      int64_t a = indptr[i], b = i + 1 < indptr.size() ? indptr[i + 1] : int64_t(data.size());
      if (a < 0 || b < a + 2 || b > int64_t(data.size())) return false;
    }
    for (int64_t body : bodies)
      if (body < 0 || body >= exprs) return false;
    for (int64_t e = 0; e < exprs; ++e) {  // every reference in range, so the walks never check
      int64_t kind = data[indptr[e]];
      const int64_t* a = args(e);
      int64_t n = nargs(e);
      if ((kind == RULE_REF || kind == REPEAT) && (n < (kind == REPEAT ? 2 : 1) || a[0] < 0 || a[0] >= rules))
        return false;
      if (kind == SEQUENCE || kind == CHOICES)
        for (int64_t i = 0; i < n; ++i)
          if (a[i] < 0 || a[i] >= e) return false;  // parts come before their expression: no cycles
      if (kind == CLASS && (n < 1 || n % 2 == 0)) return false;
    }
    return true;
  }
  int64_t kind(int64_t e) const { return data[indptr[e]]; }
  const int64_t* args(int64_t e) const { return data.data() + indptr[e] + 2; }
  int64_t nargs(int64_t e) const {
    int64_t b = e + 1 < int64_t(indptr.size()) ? indptr[e + 1] : int64_t(data.size());
    return b - indptr[e] - 2;
  }

  void refs(int64_t expr, std::vector<int64_t>& found) const {
    std::vector<int64_t> stack{expr};
    while (!stack.empty()) {
      int64_t e = stack.back();
      stack.pop_back();
      int64_t k = kind(e);
      if (k == RULE_REF || k == REPEAT) found.push_back(args(e)[0]);
      else if (k == SEQUENCE || k == CHOICES) stack.insert(stack.end(), args(e), args(e) + nargs(e));
    }
  }

  bool class_is_empty(int64_t e) const {
    const int64_t* a = args(e);
    int64_t n = (nargs(e) - 1) / 2;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t i = 0; i < n; ++i) ranges.emplace_back(a[1 + 2 * i], a[2 + 2 * i]);
    if (!a[0]) {
      for (auto& r : ranges)
        if (r.first <= r.second) return false;
      return true;
    }
    std::sort(ranges.begin(), ranges.end());
    int64_t covered = 0;
    for (auto& r : ranges) {
      if (r.first > covered) return false;
      covered = std::max(covered, r.second + 1);
    }
    return covered > MAX_CODEPOINT;
  }

  int64_t shortest(int64_t e, const std::vector<int64_t>& rules) const {
    ++visits;
    const int64_t* a = args(e);
    int64_t n = nargs(e);
    switch (kind(e)) {
      case BYTES: return n;
      case CLASS: return class_is_empty(e) ? NEVER : 1;
      case RULE_REF: return rules[a[0]];
      case SEQUENCE: {
        int64_t sum = 0;
        for (int64_t i = 0; i < n && sum < NEVER; ++i) sum += shortest(a[i], rules);
        return std::min(NEVER, sum);
      }
      case CHOICES: {
        int64_t best = NEVER;
        for (int64_t i = 0; i < n; ++i) best = std::min(best, shortest(a[i], rules));
        return best;
      }
      case REPEAT: {
        int64_t low = a[1], each = rules[a[0]];
        if (low <= 0) return 0;
        return each >= NEVER / low ? NEVER : std::min(NEVER, low * each);
      }
      default: return 0;  // empty string, a class star, a tag dispatch, later kinds: may end at once
    }
  }
};

}  // namespace

extern "C" {

// Reads `text` (n bytes), writes each rule's shortest length to `shortest` (room for `cap`
// rules), the rules reachable from the root (root first, in termination._reachable's order) to
// `reachable` and their count to `*n_reachable`, and the longest alternative to `*longest`.
// Returns the number of rules; -1: not a grammar this reads; -2: more than `cap` rules;
// -3: more than `max_visits` expressions evaluated (the caller's Python path then runs under
// the compile budget, which can stop it).
int64_t sg_grammar_lengths(const char* text, int64_t n, int64_t cap, int64_t max_visits, int64_t* shortest,
                           int64_t* reachable, int64_t* n_reachable, int64_t* longest) {
  Grammar g;
  if (!g.read(text, n)) return -1;
  int64_t rules = g.bodies.size();
  if (rules > cap) return -2;
  std::vector<std::vector<int64_t>> users(rules);
  std::vector<int64_t> found;
  for (int64_t r = 0; r < rules; ++r) {
    found.clear();
    g.refs(g.bodies[r], found);
    std::sort(found.begin(), found.end());
    found.erase(std::unique(found.begin(), found.end()), found.end());
    for (int64_t used : found) users[used].push_back(r);
  }
  std::vector<int64_t> lengths(rules, NEVER);
  std::priority_queue<int64_t> pending;  // the last rule first, as the Python heap of negated ids
  std::vector<char> queued(rules, 1);
  for (int64_t r = 0; r < rules; ++r) pending.push(r);
  while (!pending.empty()) {
    if (g.visits > max_visits) return -3;
    int64_t r = pending.top();
    pending.pop();
    queued[r] = 0;
    int64_t s = g.shortest(g.bodies[r], lengths);
    if (s < lengths[r]) {
      lengths[r] = s;
      for (int64_t user : users[r])
        if (!queued[user]) {
          queued[user] = 1;
          pending.push(user);
        }
    }
  }
  std::vector<char> seen(rules, 0);
  std::vector<int64_t> stack{g.root};
  seen[g.root] = 1;
  int64_t count = 0, most = 0;
  while (!stack.empty()) {
    int64_t r = stack.back();
    stack.pop_back();
    reachable[count++] = r;
    found.clear();
    g.refs(g.bodies[r], found);
    for (int64_t ref : found)
      if (!seen[ref]) {
        seen[ref] = 1;
        stack.push_back(ref);
      }
    int64_t body = g.bodies[r], alternative;
    if (g.kind(body) != CHOICES) {
      alternative = g.shortest(body, lengths);
    } else {
      alternative = 0;
      for (int64_t i = 0; i < g.nargs(body); ++i) alternative = std::max(alternative, g.shortest(g.args(body)[i], lengths));
    }
    most = std::max(most, alternative);
  }
  std::copy(lengths.begin(), lengths.end(), shortest);
  *n_reachable = count;
  *longest = most;
  return rules;
}

}  // extern "C"
