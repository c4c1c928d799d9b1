-- apply_layout.lua: write a layout (MemoryStore.apply_layout): replace the specs, bump the version
-- when the digest changed, fail waiting tickets that can now never be granted (their owners are
-- told by pub/sub), run a grant pass, announce the version on the layout channel.
-- A (args after now-override and replica): digest, json, pw, dw, backfill, ttl, max_scan, idle_forget_s,
-- tier order, queue order (order LSEP max_defer_s LSEP defer_s_per_token), pools, tiers, tenants
-- Reply: {changed 0/1, version}
local function apply_layout_main(A)
  local now = script_now()
  local digest = A[1]
  local changed = 0
  if rcall('HGET', K.layout, 'digest') ~= digest or rcall('EXISTS', K.spec) == 0 then
    changed = 1
    local ver = rcall('HINCRBY', K.layout, 'ver', '1')
    rcall('HSET', K.layout, 'digest', digest, 'json', A[2])
    -- T:spec: the policy, then p:/t:/n: fields for pools, tiers and tenants (see lib.lua).
    local fields = {
      'ver', ver, 'pw', A[3], 'dw', A[4], 'backfill', A[5], 'ttl', A[6], 'max_scan', A[7],
      'idle', A[8], 'tiers', A[9], 'qo', A[10],
    }
    for _, packed in ipairs({ A[11], A[12], A[13] }) do
      local entries = split(packed, LSEP)
      for i = 1, #entries do
        local j = sfind(entries[i], SEP, 1, true)
        fields[#fields + 1] = ssub(entries[i], 1, j - 1)
        fields[#fields + 1] = ssub(entries[i], j + 1)
      end
    end
    rcall('DEL', K.spec)
    hset_many(K.spec, fields)
  end
  reset_layout_cache()
  load_policy()
  upgrade(now)
  if changed == 1 then
    -- policy.drop_invalid: tickets that can never be granted now leave, then the index is rebuilt
    local all = rcall('HKEYS', K.tickets)
    table.sort(all, function(a, b)
      return tonumber(a) < tonumber(b)
    end)
    for i = 1, #all do
      local tk = load_ticket(all[i])
      local err = check_demand(tk.d)
      if err then
        rcall('LREM', qkey(tk.d.tier, tk.d.tenant), 1, tk.seq)
        rcall('ZREM', oqkey(tk.d.tier, tk.d.tenant), oq_member(tk.seq)) -- reindex rebuilds the rest
        forget(tk, pass_clock())
        local msg = 'F' .. SEP .. tk.seq .. SEP .. tk.lease .. SEP .. err[2] .. SEP .. err[3] .. SEP .. tostring(err[4] or '')
        notify(tk.owner, msg)
      end
    end
    reindex()
  end
  grant_pass(now, nil)
  if changed == 1 then
    rcall('PUBLISH', K.layout, P.ver)
  end
  return { changed, tonumber(P.ver) }
end
