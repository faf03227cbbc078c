// Plans as CSV, in torch.distributed.pipelining's spelling: one row per
// lane, one action per column, `<stage><kind><micro-batch>`.

#include <c10/util/Exception.h>
#include <gpipe/plan.h>

#include <algorithm>
#include <cctype>
#include <set>
#include <sstream>

#include "schedule/actions.h"
#include "schedule/plan_builders.h"
#include "text.h"

namespace gpipe {

namespace {

constexpr const char* kPlacementLine = "# placement:";

}  // namespace

std::string Plan::to_csv() const {
  std::ostringstream out;
  // A modulo placement shows in the rows, unless there are none to show it
  // (a plan of 0 micro-batches).
  if (!placement.empty() && (!placement.is_modulo() || micro_batches == 0)) {
    out << kPlacementLine;
    for (const auto lane : placement.lane_of_stage()) {
      out << ' ' << lane;
    }
    out << '\n';
  }
  for (const auto& lane : lanes) {
    bool first = true;
    for (const auto& c : lane) {
      out << (first ? "" : ",") << c.partition
          << detail::action_info(c.phase).letter << c.micro_batch;
      first = false;
    }
    out << '\n';
  }
  return out.str();
}

namespace {

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r");
  if (begin == std::string::npos) {
    return {};
  }
  return s.substr(begin, s.find_last_not_of(" \t\r") - begin + 1);
}

// The largest stage or micro-batch number an action may carry: nine digits,
// so that any sum of two stays far inside int64_t.
constexpr int64_t kMaxNumber = 999999999;

enum class Parsed { Ok, Malformed, OutOfRange };

// `text` with each control character as \xNN (a NUL would end the
// message where a C string is printed).
std::string printable(const std::string& text) {
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) {
      static const char* const kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    } else {
      out += ch;
    }
  }
  return out;
}

// `text` as a message quotes it: whole when short, else its first and last
// characters and its length (a field of 100,000 digits).
std::string quoted(const std::string& text) {
  constexpr size_t kEnds = 16;
  if (text.size() <= 3 * kEnds) {
    return printable(text);
  }
  return c10::str(
      printable(text.substr(0, kEnds)),
      "...",
      printable(text.substr(text.size() - kEnds)),
      " (",
      text.size(),
      " characters)");
}

// Whether a comment line is meant as a placement line: "placement" (in any
// case) right after the '#', then ':', a lane number or nothing.
bool looks_like_placement(const std::string& comment) {
  auto k = comment.find_first_not_of(" \t", 1);
  const std::string word = "placement";
  if (k == std::string::npos || comment.size() < k + word.size()) {
    return false;
  }
  for (size_t c = 0; c < word.size(); ++c) {
    if (std::tolower(static_cast<unsigned char>(comment[k + c])) != word[c]) {
      return false;
    }
  }
  k = comment.find_first_not_of(" \t", k + word.size());
  return k == std::string::npos || comment[k] == ':' ||
         std::isdigit(static_cast<unsigned char>(comment[k]));
}

// "12F3" -> (12, "F", 3), "0SEND_F3" -> (0, "SEND_F", 3). A number of more
// digits than kMaxNumber has is out of range (`too_large` names it), which
// is told apart from a malformed action.
Parsed parse_action(
    const std::string& text,
    int64_t& stage,
    std::string& kind,
    int64_t& micro,
    std::string& too_large) {
  size_t k = 0;
  bool out_of_range = false;
  auto number = [&](int64_t& value) {
    const size_t begin = k;
    while (k < text.size() &&
           std::isdigit(static_cast<unsigned char>(text[k]))) {
      ++k;
    }
    if (k == begin) {
      return false;
    }
    const auto digits = text.substr(begin, k - begin);
    const auto first = digits.find_first_not_of('0');
    if (first != std::string::npos && digits.size() - first > 9) {
      out_of_range = true;
      if (too_large.empty()) {
        too_large = digits;
      }
      return true;
    }
    value = std::stoll(digits);
    return true;
  };
  if (!number(stage)) {
    return Parsed::Malformed;
  }
  const size_t begin = k;
  while (
      k < text.size() &&
      (std::isupper(static_cast<unsigned char>(text[k])) || text[k] == '_')) {
    ++k;
  }
  kind = text.substr(begin, k - begin);
  if (!number(micro) || k != text.size()) {
    return Parsed::Malformed;
  }
  return out_of_range ? Parsed::OutOfRange : Parsed::Ok;
}

bool phase_of(const std::string& kind, Phase& phase) {
  for (const auto& a : detail::action_table()) {
    if (kind == a.read_as) {
      phase = a.phase;
      return true;
    }
  }
  return false;
}

// "0 1 1 0" after "# placement:".
Placement placement_of(const std::string& text, int64_t row) {
  std::istringstream in(text);
  std::vector<int64_t> lanes;
  std::string word;
  while (in >> word) {
    size_t used = 0;
    int64_t lane = -1;
    try {
      lane = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK_VALUE(
        used == word.size() && used > 0 && lane >= 0 && lane <= kMaxNumber,
        "plan CSV: row ",
        row,
        ": expected the lane of each stage after '",
        kPlacementLine,
        "' (numbers from 0 to ",
        kMaxNumber,
        ", separated by spaces), but got '",
        word,
        "'");
    lanes.push_back(lane);
  }
  try {
    return Placement(std::move(lanes));
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(
        false, "plan CSV: row ", row, ": ", e.what_without_backtrace());
  }
}

// The placement the rows show: each stage's cells on one row, every stage
// and every row with cells. Empty otherwise (validate() names the problem).
Placement placement_of_rows(const Plan& plan) {
  size_t cells = 0;
  for (const auto& lane : plan.lanes) {
    cells += lane.size();
  }
  if (plan.stages < 0 || static_cast<size_t>(plan.stages) > cells) {
    return {};  // a stage without cells
  }
  if (plan.stages > (int64_t{1} << 20)) {
    return {};  // more than a Placement holds: none is made up
  }
  std::vector<int64_t> lane_of(static_cast<size_t>(plan.stages), -1);
  for (size_t l = 0; l < plan.lanes.size(); ++l) {
    if (plan.lanes[l].empty()) {
      return {};
    }
    for (const auto& c : plan.lanes[l]) {
      auto& lane = lane_of[static_cast<size_t>(c.partition)];
      if (lane >= 0 && lane != static_cast<int64_t>(l)) {
        return {};
      }
      lane = static_cast<int64_t>(l);
    }
  }
  for (const auto lane : lane_of) {
    if (lane < 0) {
      return {};
    }
  }
  return Placement(std::move(lane_of));
}

}  // namespace

Plan Plan::from_csv(const std::string& text) {
  Plan plan;
  // Some editors begin a UTF-8 file with a byte order mark, which the first
  // action's error would quote invisibly.
  constexpr char kByteOrderMark[] = "\xEF\xBB\xBF";
  std::istringstream in(
      text.rfind(kByteOrderMark, 0) == 0 ? text.substr(3) : text);
  std::string line;
  int64_t row = 0;
  // B means the input part when the cell also has a W (PyTorch 2.3's
  // spelling): read every action first, then decide.
  std::set<std::pair<int64_t, int64_t>> weights;
  bool placed = false;
  while (std::getline(in, line)) {
    ++row;
    if (trim(line).rfind('#', 0) == 0) {
      TORCH_CHECK_VALUE(
          !looks_like_placement(trim(line)) ||
              trim(line).rfind(kPlacementLine, 0) == 0,
          "plan CSV: row ",
          row,
          ": expected a placement line as '",
          kPlacementLine,
          " 0 1 1 0' (the lane of each stage), but got '",
          quoted(trim(line)),
          "'");
      if (trim(line).rfind(kPlacementLine, 0) == 0) {
        TORCH_CHECK_VALUE(
            !placed, "plan CSV: row ", row, ": a second placement line");
        // Blank rows above it are the file's top margin, not idle lanes: a
        // plan written by to_csv has its placement line first.
        if (std::all_of(
                plan.lanes.begin(), plan.lanes.end(), [](const auto& lane) {
                  return lane.empty();
                })) {
          plan.lanes.clear();
        }
        // (Where blank lines around it would stand for lanes or not.)
        TORCH_CHECK_VALUE(
            plan.lanes.empty(),
            "plan CSV: row ",
            row,
            ": the placement line comes after the actions of ",
            detail::count_of(
                static_cast<int64_t>(plan.lanes.size()), "lane", "lanes"),
            "; it must come before them");
        plan.placement = placement_of(
            trim(line).substr(std::string(kPlacementLine).size()), row);
        placed = true;
      }
      continue;  // a comment
    }
    std::vector<Cell> lane;
    std::istringstream fields(line);
    std::string field;
    int64_t column = 0;
    while (std::getline(fields, field, ',')) {
      ++column;
      field = trim(field);
      if (field.empty()) {
        continue;  // an idle slot
      }
      int64_t stage = 0;
      int64_t micro = 0;
      std::string kind;
      Phase phase = Phase::Forward;
      std::string too_large;
      const auto parsed = parse_action(field, stage, kind, micro, too_large);
      TORCH_CHECK_VALUE(
          parsed != Parsed::OutOfRange || !phase_of(kind, phase),
          "plan CSV: row ",
          row,
          ", column ",
          column,
          ": the number ",
          quoted(too_large),
          " in '",
          quoted(field),
          "' is out of range: stages and micro-batches go up to ",
          kMaxNumber);
      TORCH_CHECK_VALUE(
          parsed == Parsed::Ok && phase_of(kind, phase),
          "plan CSV: row ",
          row,
          ", column ",
          column,
          ": expected an action <stage><kind><micro-batch> such as 0F3 or "
          "1RECV_F3 (kind F, B, I, W, L, SEND_F, RECV_F, SEND_B or RECV_B), "
          "but got '",
          quoted(field),
          "'");
      if (phase == Phase::BackwardWeight) {
        weights.insert({micro, stage});
      }
      plan.micro_batches = std::max(plan.micro_batches, micro + 1);
      plan.stages = std::max(plan.stages, stage + 1);
      lane.push_back(Cell{micro, stage, phase});
    }
    plan.lanes.push_back(std::move(lane));
  }
  // Blank rows at the end are not lanes (an editor's or a here-document's
  // last newline); a blank row between two rows is an empty lane.
  while (!plan.lanes.empty() && plan.lanes.back().empty()) {
    plan.lanes.pop_back();
  }
  for (auto& lane : plan.lanes) {
    for (auto& c : lane) {
      if (c.phase == Phase::Backward &&
          weights.count({c.micro_batch, c.partition}) > 0) {
        c.phase = Phase::BackwardInput;
      }
    }
  }
  if (!placed) {
    plan.placement = placement_of_rows(plan);
  } else {
    // Every stage of a plan with micro-batches has cells: a placement line
    // of another length is named here, not as a cell validate() misses.
    TORCH_CHECK_VALUE(
        plan.micro_batches == 0 || plan.placement.stages() == plan.stages,
        "plan CSV: the placement line places ",
        detail::count_of(plan.placement.stages(), "stage", "stages"),
        ", but the actions are those of ",
        detail::count_of(plan.stages, "stage", "stages"),
        " (0 to ",
        plan.stages - 1,
        ")");
    // Stages without cells (a plan of 0 micro-batches) are still placed,
    // and lanes without cells still listed.
    plan.stages = std::max(plan.stages, plan.placement.stages());
    if (static_cast<int64_t>(plan.lanes.size()) < plan.placement.lanes()) {
      plan.lanes.resize(static_cast<size_t>(plan.placement.lanes()));
    }
  }
  return plan;
}

}  // namespace gpipe
