-- quota_reserve.lua: quota.reserve. A: reservation id, ttl_s, then 7 per charge: key, limit,
-- amount, bucket, oldest, enforce (1/0), keep_s (how long the quota's hash must outlive a write).
-- Reply: {'OK', n, used_1..used_n, over...} (over: 0-based indexes of shadow charges that would
-- have refused) | {'R', index (0-based), bucket_1, total_1, ...} (nothing reserved).
local function quota_reserve_main(A)
  local now = script_now()
  local rid, ttl = A[1], A[2] + 0
  local cs = {}
  for i = 3, #A, 7 do
    cs[#cs + 1] = {
      key = A[i], rk = T .. ':quota:' .. A[i], limit = A[i + 1] + 0, amount = A[i + 2] + 0,
      bucket = A[i + 3], oldest = A[i + 4] + 0, enforce = A[i + 5] == '1', keep = A[i + 6],
    }
  end
  local reply, over = { 'OK', #cs }, {}
  for i = 1, #cs do
    local c = cs[i]
    local cells, total = QU.window(c.rk, c.oldest)
    if total + c.amount > c.limit then
      if c.enforce then
        local refused = { 'R', i - 1 }
        for bucket, cell in pairs(cells) do
          refused[#refused + 1] = fmt(bucket)
          refused[#refused + 1] = fmt(cell[1] + cell[2])
        end
        return refused
      end
      over[#over + 1] = i - 1
    end
    reply[#reply + 1] = fmt(total + c.amount)
  end
  local packed = {}
  for i = 1, #cs do
    local c = cs[i]
    rcall('HINCRBY', c.rk, c.bucket .. 'r', c.amount)
    rcall('EXPIRE', c.rk, c.keep)
    packed[i] = c.key .. SEP .. c.bucket .. SEP .. A[3 + (i - 1) * 7 + 2]
  end
  rcall('HSET', QU.held_key(), rid, table.concat(packed, LSEP))
  rcall('ZADD', QU.exp_key(), fmt(now + ttl), rid)
  for i = 1, #over do
    reply[#reply + 1] = over[i]
  end
  return reply
end
