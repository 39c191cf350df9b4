// kvslim._kvslim: the C++ library as a Python extension module (pybind11). The Python package
// (python/kvslim) wraps it: torch tensors in, config typing, the HF integration.
//
// Contract bound here: update_and_fetch (absorb a block, return the fp16 view) and view(), the
// observation hooks, and -- when the library has the attend contract (append + attend computed over
// the cache's own, possibly compressed, storage) -- append(), attend() and rows(). That contract is detected at compile
// time (bind_attend below) so this file builds against the library before and after it lands;
// once it is merged the detection can go.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "arrays.h"
#include "device_arrays.h"
#include "kvslim/kvslim.h"

namespace kvslim {
struct QueryBlock;  // defined by the attend contract's cache.h; only named in templates here
}

namespace py = pybind11;
using namespace kvslim;
using kvslim::python::as_block;
using kvslim::python::view_arrays;

namespace {

using PositionsArray = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;

std::span<const std::int64_t> as_positions(const std::optional<PositionsArray>& p, const char* name) {
  if (!p) return {};
  if (p->ndim() != 1) throw InputError(std::string(name) + ": expected a 1-D array of int64 positions");
  return {p->data(), static_cast<std::size_t>(p->shape(0))};
}

py::dict stats_dict(const CacheStats& s) {
  py::dict d;
  d["method"] = s.method;
  d["batch"] = s.batch;
  d["heads"] = s.heads;
  d["head_dim"] = s.head_dim;
  d["tokens_seen"] = s.tokens_seen;
  d["kept_per_head"] = s.kept_per_head;
  d["tokens_kept"] = s.tokens_kept;
  d["resident_bytes"] = s.resident_bytes;
  d["view_bytes"] = s.view_bytes;
  d["kept_fp16_bytes"] = s.kept_fp16_bytes;
  d["seen_fp16_bytes"] = s.seen_fp16_bytes;
  d["accounted_bytes"] = s.accounted_bytes < 0 ? py::object(py::none()) : py::object(py::float_(s.accounted_bytes));
  d["compression_ratio"] = s.compression_ratio;
  py::dict figures;
  for (const auto& [name, value] : s.figures) figures[py::str(name)] = value;
  d["figures"] = figures;
  return d;
}

// Attention probabilities of the last step, [B, H_kv, Q, T] fp32, summed over each KV group's
// query heads; T must be the tokens of the view the last update returned (rows(): checked without
// materialising the view, which a compressed cache would decode).
void observe_attention(KVCache& cache, const py::array_t<float, py::array::c_style | py::array::forcecast>& probs,
                       const PositionsArray& query_positions) {
  if (probs.ndim() != 4) throw InputError("probs: expected 4 dimensions [batch, kv_heads, queries, tokens]");
  const CacheStats st = cache.stats();
  const std::size_t rows = cache.rows();
  const auto B = static_cast<std::size_t>(probs.shape(0)), H = static_cast<std::size_t>(probs.shape(1));
  const auto Q = static_cast<std::size_t>(probs.shape(2)), T = static_cast<std::size_t>(probs.shape(3));
  if (B != st.batch || H != st.heads || T != rows) {
    throw InputError("probs: shape [" + std::to_string(B) + ", " + std::to_string(H) + ", " + std::to_string(Q) + ", " +
                     std::to_string(T) + "] does not match the cache's view [" + std::to_string(st.batch) + ", " +
                     std::to_string(st.heads) + ", queries, " + std::to_string(rows) + "]");
  }
  if (query_positions.ndim() != 1 || static_cast<std::size_t>(query_positions.shape(0)) != Q) {
    throw InputError("query_positions: expected " + std::to_string(Q) + " positions (one per query)");
  }
  cache.observe_attention(AttentionObservation{probs.data(), B, H, Q, T, T,
                                               std::span<const std::int64_t>(query_positions.data(), Q)});
}

// Hidden states before and after the attention block (plus residual), [B, T, hidden] fp32.
void observe_hidden(KVCache& cache, const py::array_t<float, py::array::c_style | py::array::forcecast>& before,
                    const py::array_t<float, py::array::c_style | py::array::forcecast>& after) {
  if (before.ndim() != 3) throw InputError("before: expected 3 dimensions [batch, tokens, hidden]");
  if (after.ndim() != 3 || after.shape(0) != before.shape(0) || after.shape(1) != before.shape(1) ||
      after.shape(2) != before.shape(2)) {
    throw InputError("after: shape must equal before's [batch, tokens, hidden]");
  }
  cache.observe_hidden(HiddenObservation{before.data(), after.data(), static_cast<std::size_t>(before.shape(0)),
                                         static_cast<std::size_t>(before.shape(1)),
                                         static_cast<std::size_t>(before.shape(2))});
}

using Float32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

// queries fp32 [B, S, H_q, D] as the cache's query block (Q: QueryBlock), scale 0 = 1/sqrt(D).
template <class Q>
Q query_block(const Float32Array& queries, float scale) {
  if (queries.ndim() != 4) throw InputError("queries: expected 4 dimensions [batch, tokens, heads, head_dim]");
  return Q{queries.data(), static_cast<std::size_t>(queries.shape(0)), static_cast<std::size_t>(queries.shape(1)),
           static_cast<std::size_t>(queries.shape(2)), static_cast<std::size_t>(queries.shape(3)), scale};
}

std::span<const std::int64_t> position_span(const PositionsArray& positions) {
  if (positions.ndim() != 1) throw InputError("query_positions: expected a 1-D array of int64 positions");
  return {positions.data(), static_cast<std::size_t>(positions.shape(0))};
}

// append / attend / rows of the attend contract. Q is QueryBlock: a template parameter so that
// nothing here is checked unless the contract exists (see bind_attend).
template <class C, class Q>
void bind_attend_methods(py::class_<C>& cls) {
  cls.def(
      "append",
      [](C& c, const py::array& keys, const py::array& values, const std::optional<PositionsArray>& positions,
         const std::string& dtype) {
        const KVBlock k = as_block(keys, dtype, "keys");
        const KVBlock v = as_block(values, dtype, "values");
        if (k.dtype != v.dtype) throw InputError("values: element type differs from keys'");
        c.append(k, v, as_positions(positions, "positions"));
      },
      py::arg("keys"), py::arg("values"), py::arg("positions") = py::none(), py::arg("dtype") = "");
  cls.def("rows", [](const C& c) { return c.rows(); });
  // queries fp32 [B, S, H_q, D] -> (out fp32 [B, S, H_q, D], probs fp32 [B, H_kv, S, rows] or None).
  cls.def(
      "attend",
      [](const C& c, const Float32Array& queries, const PositionsArray& query_positions, float scale, bool want_probs) {
        const Q q = query_block<Q>(queries, scale);
        const auto positions = position_span(query_positions);
        const auto B = queries.shape(0), S = queries.shape(1);
        py::array_t<float> out(std::vector<py::ssize_t>{B, S, queries.shape(2), queries.shape(3)});
        py::object probs = py::none();
        float* probs_ptr = nullptr;
        if (want_probs) {
          // Sized from the cache itself (never from the caller): [B, H_kv, S, rows].
          const auto kv_heads = static_cast<py::ssize_t>(c.stats().heads);
          py::array_t<float> p(std::vector<py::ssize_t>{B, kv_heads, S, static_cast<py::ssize_t>(c.rows())});
          probs_ptr = p.mutable_data();
          probs = p;
        }
        c.attend(q, positions, out.mutable_data(), probs_ptr);
        return py::make_tuple(out, probs);
      },
      py::arg("queries"), py::arg("query_positions"), py::arg("scale") = 0.0f, py::arg("want_probs") = false);
  // attend, then observe_attention of its probabilities (KVCache::attend_and_observe) -> out fp32
  // [B, S, H_q, D]; the probabilities live in a workspace of this call.
  cls.def(
      "attend_and_observe",
      [](C& c, const Float32Array& queries, const PositionsArray& query_positions, float scale) {
        const Q q = query_block<Q>(queries, scale);
        const auto positions = position_span(query_positions);
        py::array_t<float> out(std::vector<py::ssize_t>{queries.shape(0), queries.shape(1), queries.shape(2), queries.shape(3)});
        // The probabilities' workspace [B, H_kv, S, rows], sized from the cache itself: one per
        // thread, grown and reused (a layer step per token would otherwise allocate and zero it).
        static thread_local std::vector<float> probs;
        std::size_t kv_heads = 0;
        if (c.needs().attention) {
          kv_heads = c.stats().heads;
          const std::size_t n = std::max<std::size_t>(1, q.batch * kv_heads * q.tokens * c.rows());
          if (probs.size() < n) probs.resize(n);
        }
        c.attend_and_observe(q, positions, out.mutable_data(), kv_heads > 0 ? probs.data() : nullptr, kv_heads);
        return out;
      },
      py::arg("queries"), py::arg("query_positions"), py::arg("scale") = 0.0f);
}

template <class C, class Q>
bool bind_attend(py::class_<C>& cls) {
  if constexpr (requires(C& c, const C& cc, const Q& q, float* out) {
                  cc.rows();
                  cc.attend(q, std::span<const std::int64_t>{}, out, out);
                  c.append(KVBlock{}, KVBlock{}, std::span<const std::int64_t>{});
                }) {
    bind_attend_methods<C, Q>(cls);
    return true;
  } else {
    return false;
  }
}

// A RankGather written in Python (kvslim.distributed): all_gather runs the process group's
// collective. It takes the GIL, so a layer may call it from any thread. The vectors cross as
// float64 numpy arrays, not lists: a long prompt's board gathers ~10^5 values per layer.
class PyRankGather : public kvslim::RankGather {
 public:
  std::vector<std::vector<double>> all_gather(const std::vector<double>& local) override {
    py::gil_scoped_acquire gil;
    const py::function override = py::get_override(static_cast<const kvslim::RankGather*>(this), "all_gather");
    if (!override) throw std::logic_error("kvslim.RankGather subclass does not define all_gather");
    const py::object gathered = override(py::array_t<double>(static_cast<py::ssize_t>(local.size()), local.data()));
    std::vector<std::vector<double>> out;
    std::size_t rank = 0;
    for (const py::handle item : gathered) {
      const auto a = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(item);
      if (!a || a.ndim() != 1) {
        throw kvslim::InputError("RankGather.all_gather: rank " + std::to_string(rank) +
                                 "'s entry is not a 1-d sequence of floats");
      }
      out.emplace_back(a.data(), a.data() + a.size());
      ++rank;
    }
    return out;
  }
};

}  // namespace

PYBIND11_MODULE(_kvslim, m) {
  m.doc() = "kvslim C++ core (use the kvslim package, not this module directly)";

  // Library errors become Python exceptions; both are ValueErrors (bad values, named in the text).
  py::register_exception<ConfigError>(m, "ConfigError", PyExc_ValueError);
  py::register_exception<InputError>(m, "InputError", PyExc_ValueError);

  m.def("methods", &method_names, "Method ids, in the library's order.");
  // The registry's row of a method (kvslim/methods.h), as a dict.
  m.def(
      "method_info",
      [](const std::string& name) {
        const MethodInfo& info = method_info(name);
        auto field_of = [](int KVCacheConfig::*p) -> py::object {
          if (p == nullptr) return py::none();
          return py::str(std::string(config_field_name(p)));
        };
        static const char* kinds[] = {"dense", "eviction", "quantizer"};
        py::dict d;
        d["name"] = std::string(info.name);
        d["summary"] = std::string(info.summary);
        d["kind"] = kinds[static_cast<int>(info.kind)];
        d["budget_field"] = field_of(info.budget);
        d["sink_field"] = field_of(info.n_sink);
        d["h2o_core"] = info.h2o_core;
        d["cuda"] = info.cuda;
        d["fields"] = info.fields();
        py::list variants;
        for (const EvalVariant& v : info.variants) {
          py::dict e;
          e["name"] = std::string(v.name);
          e["description"] = std::string(v.description);
          e["settings"] = std::string(v.settings);
          e["compares_to"] = std::string(v.compares_to);
          e["quick"] = v.quick;
          e["composed"] = v.composed();
          e["recent_window_fraction"] = v.recent_window_fraction;
          e["reconstruction_weight"] = v.reconstruction_weight;
          e["prefill_full_prompt"] = v.prefill_full_prompt;
          e["eval_only"] = v.eval_only();  // data only kvslim eval applies: its name is not a config spec
          variants.append(e);
        }
        d["variants"] = variants;
        return d;
      },
      "The method's row of the library's registry: name, summary, kind, budget/sink fields, its own fields, "
      "its kvslim eval variants.");
  m.def(
      "variants",
      [] {
        std::vector<std::string> names;
        for (const EvalVariant* v : eval_variants()) names.emplace_back(v->name);
        return names;
      },
      "The registry's eval variants, in kvslim eval's order.");
  m.def(
      "config_from_spec", [](const std::string& spec) { return config_from_spec(spec); },
      "A config from a method spec: METHOD or VARIANT, optionally @field=value,... (kvslim/methods.h).");
  m.def("storages", [] { return storage_names(); }, "Storage kinds of an eviction method's rows (Config.storage).");
  // Where a KVBlock made from this array points (tests: inputs are read in place, not copied).
  m.def("_block_address", [](const py::array& a, const std::string& dtype) {
    return reinterpret_cast<std::uintptr_t>(as_block(a, dtype, "array").data);
  });
  m.def("simd_target", &simd_target_name, "Instruction set the run-time dispatcher picked.");
  m.def("attend_kernels", &attend_packed_kernels,
        "How Cache.attend reads kivi / zipcache codes on this CPU: int8 dot products (AVX-512 VNNI + VBMI) "
        "or the fp32 kernels of the dispatched instruction set.");

  py::class_<KVCacheConfig>(m, "Config")
      .def(py::init<>())
      .def("set", [](KVCacheConfig& c, const std::string& f, const std::string& v) { c.set(f, v); })
      .def("fields", &KVCacheConfig::fields)
      .def("validate", &KVCacheConfig::validate)
      .def("copy", [](const KVCacheConfig& c) { return KVCacheConfig(c); });

  py::class_<KVCache> cache_class(m, "Cache");
  cache_class
      .def(
          "update_and_fetch",
          [](py::object self, const py::array& keys, const py::array& values, const std::optional<PositionsArray>& positions,
             const std::string& dtype, bool copy) {
            KVCache& c = self.cast<KVCache&>();
            const KVBlock k = as_block(keys, dtype, "keys");
            const KVBlock v = as_block(values, dtype, "values");
            if (k.dtype != v.dtype) throw InputError("values: element type differs from keys'");
            // Threads: no call of this module releases the GIL, so calls on one cache from several
            // Python threads are serialised by it; the view is copied (copy=true) before the call
            // returns, i.e. before another thread can change the cache (issue 26).
            const CacheView view = c.update_and_fetch(k, v, as_positions(positions, "positions"));
            return view_arrays(view, self, copy);
          },
          py::arg("keys"), py::arg("values"), py::arg("positions") = py::none(), py::arg("dtype") = "", py::arg("copy") = true)
      .def("view", [](py::object self, bool copy) { return view_arrays(self.cast<KVCache&>().view(), self, copy); },
           py::arg("copy") = true)
      .def("stats", [](const KVCache& c) { return stats_dict(c.stats()); })
      .def("reset", &KVCache::reset)
      .def("reserve", &KVCache::reserve, py::arg("tokens"))
      .def("needs",
           [](const KVCache& c) {
             const ObservationNeeds n = c.needs();
             py::dict d;
             d["attention"] = n.attention;
             d["hidden_states"] = n.hidden_states;
             d["attention_queries"] = n.attention_queries;
             return d;
           })
      .def("observe_attention", &observe_attention, py::arg("probs"), py::arg("query_positions"))
      .def("observe_hidden", &observe_hidden, py::arg("before"), py::arg("after"))
      .def_property_readonly("method", [](const KVCache& c) { return std::string(c.method()); })
      .def_property_readonly("layer_id", &KVCache::layer_id);
  m.attr("has_attend") = bind_attend<KVCache, QueryBlock>(cache_class);
  kvslim::python::bind_device_methods(m, cache_class);

  m.def("create_cache", &KVCacheFactory::create, py::arg("config"),
        "A lone cache (no coordinator: squeeze behaves as uniform-budget H2O).");

  py::class_<RankGather, PyRankGather, std::shared_ptr<RankGather>>(m, "RankGather",
                                                                    "Every rank's list of floats, in rank order (a collective).")
      .def(py::init<>())
      .def("all_gather", &RankGather::all_gather, py::arg("local"));

  py::class_<CacheSet>(m, "CacheSet")
      .def(py::init([](const KVCacheConfig& config, const std::vector<std::tuple<bool, int, int>>& layers) {
             ModelSpec spec;
             for (const auto& [attention, kv_heads, head_dim] : layers) spec.layers.push_back({attention, kv_heads, head_dim});
             return KVCacheBuilder::for_model(spec, config);
           }),
           py::arg("config"), py::arg("layers"))
      .def("__len__", &CacheSet::size)
      .def(
          "layer",
          [](const CacheSet& s, std::size_t i) -> KVCache* {
            if (i >= s.size()) throw py::index_error("CacheSet has " + std::to_string(s.size()) + " layers, not " + std::to_string(i + 1));
            return s[i];  // null (None) for a layer without attention
          },
          py::return_value_policy::reference_internal)
      .def("reset", &CacheSet::reset)
      .def("set_rank_gather", &CacheSet::set_rank_gather, py::arg("gather"))
      .def_property_readonly("needs_rank_gather", &CacheSet::needs_rank_gather)
      .def("reserve", &CacheSet::reserve, py::arg("tokens"))
      .def("resident_bytes", &CacheSet::resident_bytes)
      .def("seen_fp16_bytes", &CacheSet::seen_fp16_bytes);
}
